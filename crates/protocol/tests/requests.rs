//! Request parsing at the boundary: every verb, every error code, id echo, bounds, and a
//! no-panic property over arbitrary bytes and arbitrary JSON objects.

use std::collections::BTreeMap;

use estop_kernel::SagaAction;
use estop_kernel::ids::{Digest, EffectKey, PrincipalName, Role, RunId, ToolName};
use estop_kernel::vocab::{Decision, Outcome, RunState};
use estop_protocol::limits::*;
use estop_protocol::{
    Admit, CloseOutcome, Complete, ErrorCode, Id, Op, PendingCursor, Request, RequestedRunLimits,
    Secret, Verb, digest_of, parse_request,
};
use proptest::prelude::*;
use serde_json::{Value, json};

fn run(s: &str) -> RunId {
    RunId::new(s).expect("run")
}
fn key(s: &str) -> EffectKey {
    EffectKey::new(s).expect("key")
}
fn tool(s: &str) -> ToolName {
    ToolName::new(s).expect("tool")
}

fn ok(line: &str) -> Request {
    match parse_request(line.as_bytes()) {
        Ok(r) => r,
        Err(e) => panic!("{line}: {e} ({})", e.code()),
    }
}

fn op(line: &str) -> Op {
    ok(line).op
}

/// Asserts the line is refused with `code`, naming `field` when given.
fn refused(line: &str, code: ErrorCode, field: Option<&str>) {
    match parse_request(line.as_bytes()) {
        Ok(r) => panic!("{line}: parsed as {r:?}, expected {code}"),
        Err(e) => {
            assert_eq!(e.code(), code, "{line}: {e}");
            if field.is_some() {
                assert_eq!(e.field(), field, "{line}: {e}");
            }
        }
    }
}

fn admit_base() -> Admit {
    let args = json!({"amount": 10, "to": "acct-1"});
    Admit {
        run: run("r1"),
        key: key("k1"),
        tool: tool("refund"),
        digest: digest_of(&tool("refund"), &args),
        args: Some(args),
        start: true,
        parent: None,
        labels: BTreeMap::new(),
        needs_approval: false,
        declare: None,
        seed: None,
        limits: RequestedRunLimits::default(),
        reserve: Default::default(),
    }
}

#[test]
fn every_verb_parses() {
    let d = Digest([0xab; 32]);
    let admit_with_digest = format!(
        r#"{{"op":"admit","run":"r1","key":"k1","tool":"refund","digest":"{}","start":false,
            "parent":"p0","labels":{{"team":"pay"}},"needs_approval":true,
            "limits":{{"deadline_ms":1700000000000,"timeout_ms":5000,"max_effects":9,
            "max_spend":5000000,"max_tokens":70000}},"reserve":{{"usd_micros":12,"tokens":3}}}}"#,
        d.to_hex()
    );
    let table: Vec<(&str, Op)> = vec![
        (
            r#"{"op":"hello","token":"s3cret"}"#,
            Op::Hello {
                token: Secret::new("s3cret"),
                run: None,
                component: Default::default(),
            },
        ),
        (
            r#"{"op":"hello","token":"s3cret","run":"order-42"}"#,
            Op::Hello {
                token: Secret::new("s3cret"),
                run: Some(run("order-42")),
                component: Default::default(),
            },
        ),
        (
            r#"{"op":"admit","run":"r1","key":"k1","tool":"refund","args":{"to":"acct-1","amount":10}}"#,
            Op::Admit(admit_base()),
        ),
        (
            &admit_with_digest,
            Op::Admit(Admit {
                args: None,
                digest: d,
                start: false,
                parent: Some(run("p0")),
                labels: BTreeMap::from([("team".to_string(), "pay".to_string())]),
                needs_approval: true,
                declare: None,
                seed: None,
                limits: RequestedRunLimits {
                    deadline_ms: Some(1_700_000_000_000),
                    timeout_ms: Some(5000),
                    max_effects: Some(9),
                    max_spend: Some(5_000_000),
                    max_tokens: Some(70_000),
                },
                reserve: estop_kernel::Spend {
                    usd_micros: 12,
                    tokens: 3,
                },
                ..admit_base()
            }),
        ),
        (
            r#"{"op":"start","run":"r1","key":"k1","token":"t"}"#,
            Op::Start {
                run: run("r1"),
                key: key("k1"),
                token: "t".into(),
            },
        ),
        (
            r#"{"op":"complete","run":"r1","key":"k1","token":"t","outcome":"ok","result":{"id":"re_1"},"cost":{"usd_micros":7}}"#,
            Op::Complete(Complete {
                run: run("r1"),
                key: key("k1"),
                token: "t".into(),
                outcome: Outcome::Ok,
                result: Some(json!({"id": "re_1"})),
                error: None,
                cost: estop_kernel::Spend {
                    usd_micros: 7,
                    tokens: 0,
                },
            }),
        ),
        (
            r#"{"op":"complete","run":"r1","key":"k1","token":"t","outcome":"error","error":"503"}"#,
            Op::Complete(Complete {
                run: run("r1"),
                key: key("k1"),
                token: "t".into(),
                outcome: Outcome::Error,
                result: None,
                error: Some("503".into()),
                cost: Default::default(),
            }),
        ),
        (
            r#"{"op":"wait","run":"r1","key":"k1","timeout_ms":30000}"#,
            Op::Wait {
                run: run("r1"),
                key: key("k1"),
                timeout_ms: 30_000,
            },
        ),
        (
            r#"{"op":"subscribe","run":"r1"}"#,
            Op::Subscribe { run: run("r1") },
        ),
        (
            r#"{"op":"unsubscribe","run":"r1"}"#,
            Op::Unsubscribe { run: run("r1") },
        ),
        (
            r#"{"op":"status","run":"r1"}"#,
            Op::Status { run: run("r1") },
        ),
        (
            r#"{"op":"cancel","run":"r1"}"#,
            Op::Cancel {
                run: run("r1"),
                reason: None,
                cascade: true,
            },
        ),
        (
            r#"{"op":"cancel","run":"r1","reason":"user hit stop","cascade":false}"#,
            Op::Cancel {
                run: run("r1"),
                reason: Some("user hit stop".into()),
                cascade: false,
            },
        ),
        (r#"{"op":"ping"}"#, Op::Ping),
        (
            r#"{"op":"decide","run":"r1","key":"k1","decision":"approve"}"#,
            Op::Decide {
                run: run("r1"),
                key: key("k1"),
                decision: Decision::Approve,
                reason: None,
            },
        ),
        (
            r#"{"op":"decide","run":"r1","key":"k1","decision":"reject","reason":"too much"}"#,
            Op::Decide {
                run: run("r1"),
                key: key("k1"),
                decision: Decision::Reject,
                reason: Some("too much".into()),
            },
        ),
        (r#"{"op":"pause","run":"r1"}"#, Op::Pause { run: run("r1") }),
        (
            r#"{"op":"resume","run":"r1"}"#,
            Op::Resume { run: run("r1") },
        ),
        (
            r#"{"op":"kill","run":"r1","reason":"runaway"}"#,
            Op::Kill {
                run: run("r1"),
                reason: Some("runaway".into()),
            },
        ),
        (
            r#"{"op":"close","run":"r1"}"#,
            Op::Close {
                run: run("r1"),
                outcome: CloseOutcome::Completed,
            },
        ),
        (
            r#"{"op":"close","run":"r1","outcome":"failed"}"#,
            Op::Close {
                run: run("r1"),
                outcome: CloseOutcome::Failed,
            },
        ),
        (
            r#"{"op":"runs"}"#,
            Op::Runs {
                state: None,
                limit: None,
                cursor: None,
            },
        ),
        (
            r#"{"op":"runs","state":"paused","limit":50,"cursor":"r0"}"#,
            Op::Runs {
                state: Some(RunState::Paused),
                limit: Some(50),
                cursor: Some(run("r0")),
            },
        ),
        (
            r#"{"op":"pending"}"#,
            Op::Pending {
                run: None,
                limit: None,
                cursor: None,
            },
        ),
        (
            r#"{"op":"pending","run":"r1","limit":3,"cursor":"[5,\"r1\",\"k\"]"}"#,
            Op::Pending {
                run: Some(run("r1")),
                limit: Some(3),
                cursor: Some(PendingCursor {
                    expires_at: 5,
                    run: run("r1"),
                    key: key("k"),
                }),
            },
        ),
        (
            r#"{"op":"ledger"}"#,
            Op::Ledger {
                run: None,
                limit: None,
                after: None,
            },
        ),
        (
            r#"{"op":"ledger","run":"r1","limit":10,"after":99}"#,
            Op::Ledger {
                run: Some(run("r1")),
                limit: Some(10),
                after: Some(99),
            },
        ),
        (
            r#"{"op":"report","run":"r1"}"#,
            Op::Report {
                run: run("r1"),
                limit: None,
                cursor: None,
            },
        ),
        (
            r#"{"op":"report","run":"r1","limit":2,"cursor":"k9"}"#,
            Op::Report {
                run: run("r1"),
                limit: Some(2),
                cursor: Some(key("k9")),
            },
        ),
        (
            r#"{"op":"token","name":"alice","role":"operator","groups":["finance"]}"#,
            Op::Token {
                name: PrincipalName::new("alice").expect("name"),
                role: Role::Operator,
                groups: vec!["finance".into()],
            },
        ),
        (
            r#"{"op":"token","name":"bot","role":"agent"}"#,
            Op::Token {
                name: PrincipalName::new("bot").expect("name"),
                role: Role::Agent,
                groups: vec![],
            },
        ),
        (
            r#"{"op":"token","name":"prom","role":"observer"}"#,
            Op::Token {
                name: PrincipalName::new("prom").expect("name"),
                role: Role::Observer,
                groups: vec![],
            },
        ),
        (
            r#"{"op":"token_revoke","name":"bot"}"#,
            Op::TokenRevoke {
                name: PrincipalName::new("bot").expect("name"),
            },
        ),
        (
            r#"{"op":"compensations"}"#,
            Op::Compensations {
                run: None,
                tool: None,
            },
        ),
        (
            r#"{"op":"compensations","run":"r1"}"#,
            Op::Compensations {
                run: Some(run("r1")),
                tool: None,
            },
        ),
        (
            r#"{"op":"compensations","tool":"http.*"}"#,
            Op::Compensations {
                run: None,
                tool: Some(ToolName::new("http.*").unwrap()),
            },
        ),
        (
            r#"{"op":"compensated","run":"r1","key":"k1","attempt":2,"outcome":"error","error":"503"}"#,
            Op::Compensated {
                run: run("r1"),
                key: key("k1"),
                attempt: 2,
                outcome: Outcome::Error,
                error: Some("503".into()),
            },
        ),
        (
            r#"{"op":"saga","run":"r1","key":"k1","action":"settle","outcome":"ok"}"#,
            Op::Saga {
                run: run("r1"),
                key: key("k1"),
                action: SagaAction::Settle {
                    outcome: Outcome::Ok,
                    result: None,
                },
            },
        ),
        (
            r#"{"op":"saga","run":"r1","key":"k1","action":"settle","outcome":"ok","result":{"id":"ch_1"}}"#,
            Op::Saga {
                run: run("r1"),
                key: key("k1"),
                action: SagaAction::Settle {
                    outcome: Outcome::Ok,
                    result: Some(r#"{"id":"ch_1"}"#.into()),
                },
            },
        ),
        (
            r#"{"op":"saga","run":"r1","key":"k1","action":"settle","outcome":"unknown"}"#,
            Op::Saga {
                run: run("r1"),
                key: key("k1"),
                action: SagaAction::Settle {
                    outcome: Outcome::Unknown,
                    result: None,
                },
            },
        ),
        (
            r#"{"op":"saga","run":"r1","key":"k1","action":"compensate"}"#,
            Op::Saga {
                run: run("r1"),
                key: key("k1"),
                action: SagaAction::Compensate,
            },
        ),
        (
            r#"{"op":"looked_up","run":"r1","key":"k1","attempt":1,"outcome":"ok","result":{"id":"ch_1"}}"#,
            Op::LookedUp {
                run: run("r1"),
                key: key("k1"),
                attempt: 1,
                outcome: Outcome::Ok,
                result: Some(serde_json::json!({"id": "ch_1"})),
                error: None,
            },
        ),
        (
            r#"{"op":"saga","run":"r1","key":"k1","action":"retry"}"#,
            Op::Saga {
                run: run("r1"),
                key: key("k1"),
                action: SagaAction::Retry,
            },
        ),
        (
            r#"{"op":"saga","run":"r1","key":"k1","action":"skip","reason":"refunded by hand"}"#,
            Op::Saga {
                run: run("r1"),
                key: key("k1"),
                action: SagaAction::Skip {
                    reason: "refunded by hand".into(),
                },
            },
        ),
    ];
    let mut verbs_seen = std::collections::BTreeSet::new();
    for (line, expected) in table {
        let got = op(line);
        assert_eq!(got, expected, "{line}");
        verbs_seen.insert(got.verb());
        // What a client renders, the server parses back to the same request.
        let req = Request::new(Id::from_u64(1), got);
        let again = ok(std::str::from_utf8(&req.to_line()).expect("utf8"));
        assert_eq!(again, req, "round trip of {line}");
    }
    assert_eq!(
        verbs_seen.len(),
        Verb::ALL.len(),
        "a verb has no parse test"
    );
}

#[test]
fn verbs_know_their_role_and_run() {
    assert!(Verb::Decide.is_operator_only());
    assert!(!Verb::Admit.is_operator_only());
    assert!(Verb::Ping.allowed_before_hello() && Verb::Hello.allowed_before_hello());
    assert!(!Verb::Status.allowed_before_hello());
    assert_eq!(op(r#"{"op":"status","run":"r9"}"#).run(), Some(&run("r9")));
    assert_eq!(op(r#"{"op":"runs"}"#).run(), None);
    for v in Verb::ALL {
        assert_eq!(Verb::parse(v.as_str()), Some(*v));
        // Operators use every verb; agents all but the operator-only ones; observers only
        // the reads, and no read is operator-only but the raw ledger and token changes.
        assert!(v.allowed_for(Role::Operator));
        assert_eq!(v.allowed_for(Role::Agent), !v.is_operator_only(), "{v}");
        assert_eq!(v.allowed_for(Role::Observer), v.is_read_only(), "{v}");
        // Executors only the reverse saga's verbs.
        let saga = [
            Verb::Hello,
            Verb::Ping,
            Verb::Compensations,
            Verb::Compensated,
            Verb::LookedUp,
        ];
        assert_eq!(v.allowed_for(Role::Executor), saga.contains(v), "{v}");
    }
    for v in [
        Verb::Decide,
        Verb::Cancel,
        Verb::Kill,
        Verb::Pause,
        Verb::Resume,
        Verb::Close,
    ]
    .into_iter()
    .chain([Verb::Admit, Verb::Start, Verb::Complete, Verb::Wait])
    .chain([Verb::Token, Verb::TokenRevoke])
    {
        assert!(!v.allowed_for(Role::Observer), "{v}");
    }
    assert!(Verb::Ledger.allowed_for(Role::Observer) && !Verb::Ledger.allowed_for(Role::Agent));
}

#[test]
fn ids_that_would_show_as_something_else_are_refused_and_free_text_is_kept() {
    for (field, bad) in [
        ("run", "r\u{202e}1"),
        ("key", "k\u{200b}"),
        ("tool", "pay\u{2066}"),
        ("parent", "p\u{feff}"),
    ] {
        let mut v: serde_json::Value =
            serde_json::from_str(r#"{"op":"admit","run":"r","key":"k","tool":"pay","args":{}}"#)
                .unwrap();
        v[field] = json!(bad);
        refused(&v.to_string(), ErrorCode::InvalidField, Some(field));
    }
    refused(
        r#"{"op":"admit","run":"r","key":"k","tool":"pay","args":{},"labels":{"a\u061cb":"x"}}"#,
        ErrorCode::InvalidField,
        Some("labels"),
    );
    let Op::Cancel { reason, .. } =
        op(r#"{"op":"cancel","run":"r","reason":"a\u202e\n\u001b[0m"}"#)
    else {
        panic!("cancel")
    };
    assert_eq!(
        reason.as_deref(),
        Some("a\u{202e}\n\u{1b}[0m"),
        "free text is kept exactly"
    );
}

#[test]
fn admit_digest_comes_from_args_or_is_taken_as_given() {
    let Op::Admit(a) =
        op(r#"{"op":"admit","run":"r","key":"k","tool":"t","args":{"b":1.0,"a":2}}"#)
    else {
        panic!("not admit")
    };
    assert_eq!(a.digest, digest_of(&tool("t"), &json!({"a": 2, "b": 1})));
    // `null` is a value for args (a tool without arguments), not an absence.
    let Op::Admit(a) = op(r#"{"op":"admit","run":"r","key":"k","tool":"t","args":null}"#) else {
        panic!("not admit")
    };
    assert_eq!(a.args, Some(Value::Null));
    assert_eq!(a.digest, digest_of(&tool("t"), &Value::Null));
    let hex = "AB".repeat(32);
    let Op::Admit(a) = op(&format!(
        r#"{{"op":"admit","run":"r","key":"k","tool":"t","digest":"{hex}"}}"#
    )) else {
        panic!("not admit")
    };
    assert_eq!((a.args, a.digest), (None, Digest([0xab; 32])));
}

#[test]
fn defaults_and_null_as_absent() {
    let Op::Admit(a) = op(
        r#"{"op":"admit","run":"r","key":"k","tool":"t","args":{},"start":null,"parent":null,"labels":null,"needs_approval":null,"limits":null}"#,
    ) else {
        panic!("not admit")
    };
    assert!(
        a.start
            && !a.needs_approval
            && a.parent.is_none()
            && a.labels.is_empty()
            && a.limits.is_empty()
    );
    assert_eq!(
        op(r#"{"op":"cancel","run":"r","reason":null,"cascade":null}"#),
        Op::Cancel {
            run: run("r"),
            reason: None,
            cascade: true
        }
    );
}

#[test]
fn unknown_fields_are_ignored() {
    assert_eq!(
        op(r#"{"op":"ping","future":{"deep":[1,2,{"x":null}]},"v":2}"#),
        Op::Ping
    );
    // Fields another verb reads are ignored too, whatever their type.
    assert_eq!(
        op(r#"{"op":"status","run":"r","tool":"t","timeout_ms":"soon"}"#),
        Op::Status { run: run("r") }
    );
    assert_eq!(
        op(r#"{"op":"status","tool":"a","tool":"b","run":"r"}"#),
        Op::Status { run: run("r") }
    );
    // ... and the id survives that second look byte for byte.
    let r = ok(r#"{"id":1.50,"op":"status","timeout_ms":"soon","run":"r"}"#);
    assert_eq!(
        (r.id.as_json(), r.op),
        ("1.50", Op::Status { run: run("r") })
    );
    assert_eq!(Verb::Cancel.fields(), vec!["run", "reason", "cascade"]);
    assert_eq!(Verb::Ping.fields(), Vec::<&str>::new());
}

#[test]
fn ids_are_echoed_exactly() {
    assert_eq!(ok(r#"{"id":7,"op":"ping"}"#).id.as_json(), "7");
    assert_eq!(ok(r#"{"id":1.50,"op":"ping"}"#).id.as_json(), "1.50");
    assert_eq!(ok(r#"{"id":-3e2,"op":"ping"}"#).id.as_json(), "-3e2");
    assert_eq!(
        ok(r#"{"op":"ping","id":"a\"b\u00e9"}"#).id.as_json(),
        r#""a\"b\u00e9""#
    );
    assert_eq!(ok(r#"{"op":"ping"}"#).id, Id::NULL);
    assert_eq!(ok(r#"{"op":"ping","id":null}"#).id, Id::NULL);
    assert_eq!(ok(r#"{ "id" : 42 , "op" : "ping" }"#).id.as_json(), "42");
}

#[test]
fn error_replies_still_echo_the_id() {
    // The bad field comes before the id; the id is recovered all the same.
    let e = parse_request(br#"{"op":"status","run":5,"id":"req-9"}"#).expect_err("bad run");
    assert_eq!(
        (e.code(), e.id.as_json()),
        (ErrorCode::InvalidField, r#""req-9""#)
    );
    let e = parse_request(br#"{"id":3,"op":"fly"}"#).expect_err("unknown op");
    assert_eq!((e.code(), e.id.as_json()), (ErrorCode::UnknownOp, "3"));
    let line = String::from_utf8(e.to_line()).expect("utf8");
    assert!(
        line.starts_with(
            r#"{"id":3,"ok":false,"error":{"code":"unknown_op","message":"unknown op \"fly\""#
        ),
        "{line}"
    );
    assert!(line.ends_with("}}\n"));
    // Unreadable JSON has no id to echo.
    let e = parse_request(br#"{"id":3,"op":"#).expect_err("truncated");
    assert_eq!((e.code(), e.id.clone()), (ErrorCode::BadJson, Id::NULL));
}

#[test]
fn every_parse_error_code_fires() {
    use ErrorCode::*;
    let long = "x".repeat(300);
    let hex = "ab".repeat(32);
    let cases: Vec<(String, ErrorCode, Option<&str>)> = vec![
        // bad_json: malformed, truncated, not an object, trailing garbage, empty.
        ("{".into(), BadJson, None),
        ("nope".into(), BadJson, None),
        ("[1,2]".into(), BadJson, None),
        ("\"ping\"".into(), BadJson, None),
        ("".into(), BadJson, None),
        (r#"{"op":"ping"} {"op":"ping"}"#.into(), BadJson, None),
        (r#"{"op":"ping","x":tru}"#.into(), BadJson, None),
        ("{\"op\":\"ping\",\"x\":\"\u{1}\"}".into(), BadJson, None),
        // unknown_op
        (r#"{"op":"fly"}"#.into(), UnknownOp, None),
        (r#"{"op":"PING"}"#.into(), UnknownOp, None),
        // missing_field
        (r#"{}"#.into(), MissingField, Some("op")),
        (r#"{"op":null}"#.into(), MissingField, Some("op")),
        (r#"{"op":"hello"}"#.into(), MissingField, Some("token")),
        (r#"{"op":"admit","key":"k","tool":"t","args":{}}"#.into(), MissingField, Some("run")),
        (r#"{"op":"admit","run":"r","tool":"t","args":{}}"#.into(), MissingField, Some("key")),
        (r#"{"op":"admit","run":"r","key":"k","args":{}}"#.into(), MissingField, Some("tool")),
        (r#"{"op":"start","run":"r","key":"k"}"#.into(), MissingField, Some("token")),
        (r#"{"op":"complete","run":"r","key":"k","token":"t"}"#.into(), MissingField, Some("outcome")),
        (r#"{"op":"wait","run":"r","key":"k"}"#.into(), MissingField, Some("timeout_ms")),
        (r#"{"op":"decide","run":"r","key":"k"}"#.into(), MissingField, Some("decision")),
        (r#"{"op":"token","role":"agent"}"#.into(), MissingField, Some("name")),
        (r#"{"op":"token","name":"a"}"#.into(), MissingField, Some("role")),
        (r#"{"op":"status","run":null}"#.into(), MissingField, Some("run")),
        // invalid_field: types
        (r#"{"op":5}"#.into(), InvalidField, Some("op")),
        (r#"{"op":"status","run":5}"#.into(), InvalidField, Some("run")),
        (r#"{"op":"admit","run":"r","key":"k","tool":"t","args":{},"start":"yes"}"#.into(), InvalidField, Some("start")),
        (r#"{"op":"wait","run":"r","key":"k","timeout_ms":-1}"#.into(), InvalidField, Some("timeout_ms")),
        (r#"{"op":"wait","run":"r","key":"k","timeout_ms":1.5}"#.into(), InvalidField, Some("timeout_ms")),
        (r#"{"op":"admit","run":"r","key":"k","tool":"t","args":{},"labels":{"a":1}}"#.into(), InvalidField, Some("labels")),
        (r#"{"op":"admit","run":"r","key":"k","tool":"t","args":{},"limits":{"max_effects":"9"}}"#.into(), InvalidField, Some("limits")),
        (r#"{"op":"token","name":"a","role":"agent","groups":"finance"}"#.into(), InvalidField, Some("groups")),
        (r#"{"op":"admit","run":"r","key":"k","tool":"t","args":{},"reserve":{"usd_micros":-1}}"#.into(), InvalidField, Some("reserve")),
        (r#"{"op":"admit","run":"r","key":"k","tool":"t","args":{},"reserve":{"dollars":1}}"#.into(), InvalidField, Some("reserve")),
        (r#"{"op":"admit","run":"r","key":"k","tool":"t","args":{},"reserve":{"tokens":1000000000001}}"#.into(), InvalidField, Some("reserve")),
        (r#"{"op":"complete","run":"r","key":"k","token":"t","outcome":"ok","cost":{"usd_micros":1000000000001}}"#.into(), InvalidField, Some("cost")),
        // invalid_field: ids and values
        (r#"{"op":"status","run":""}"#.into(), InvalidField, Some("run")),
        (format!(r#"{{"op":"status","run":"{long}"}}"#), InvalidField, Some("run")),
        (r#"{"op":"status","run":"a\nb"}"#.into(), InvalidField, Some("run")),
        (r#"{"op":"start","run":"r","key":"","token":"t"}"#.into(), InvalidField, Some("key")),
        (r#"{"op":"admit","run":"r","key":"k","tool":"","args":{}}"#.into(), InvalidField, Some("tool")),
        (r#"{"op":"admit","run":"r","key":"k","tool":"t","args":{},"parent":""}"#.into(), InvalidField, Some("parent")),
        (r#"{"op":"admit","run":"r","key":"k","tool":"t","digest":"abc"}"#.into(), InvalidField, Some("digest")),
        (format!(r#"{{"op":"admit","run":"r","key":"k","tool":"t","digest":"{}zz"}}"#, &hex[2..]), InvalidField, Some("digest")),
        (format!(r#"{{"op":"admit","run":"r","key":"k","tool":"t","args":{{}},"digest":"{hex}"}}"#), InvalidField, Some("args")),
        (r#"{"op":"admit","run":"r","key":"k","tool":"t"}"#.into(), InvalidField, Some("args")),
        (r#"{"op":"complete","run":"r","key":"k","token":"t","outcome":"maybe"}"#.into(), InvalidField, Some("outcome")),
        (r#"{"op":"decide","run":"r","key":"k","decision":"yes"}"#.into(), InvalidField, Some("decision")),
        (r#"{"op":"close","run":"r","outcome":"cancelled"}"#.into(), InvalidField, Some("outcome")),
        (r#"{"op":"runs","state":"sleeping"}"#.into(), InvalidField, Some("state")),
        // the saga's verbs
        (r#"{"op":"compensated","run":"r","key":"k","outcome":"ok"}"#.into(), MissingField, Some("attempt")),
        (r#"{"op":"compensated","run":"r","key":"k","attempt":0,"outcome":"ok"}"#.into(), InvalidField, Some("attempt")),
        (r#"{"op":"compensated","run":"r","key":"k","attempt":4294967296,"outcome":"ok"}"#.into(), InvalidField, Some("attempt")),
        (r#"{"op":"compensated","run":"r","key":"k","attempt":1,"outcome":"done"}"#.into(), InvalidField, Some("outcome")),
        (r#"{"op":"saga","run":"r","key":"k"}"#.into(), MissingField, Some("action")),
        (r#"{"op":"saga","run":"r","key":"k","action":"undo"}"#.into(), InvalidField, Some("action")),
        (r#"{"op":"saga","run":"r","key":"k","action":"settle"}"#.into(), MissingField, Some("outcome")),
        (r#"{"op":"saga","run":"r","key":"k","action":"settle","outcome":"maybe"}"#.into(), InvalidField, Some("outcome")),
        (r#"{"op":"saga","run":"r","key":"k","action":"settle","outcome":"error","result":{}}"#.into(), InvalidField, Some("result")),
        (r#"{"op":"looked_up","run":"r","key":"k","attempt":1,"outcome":"unknown","result":1}"#.into(), InvalidField, Some("result")),
        (r#"{"op":"looked_up","run":"r","key":"k","attempt":1,"outcome":"found"}"#.into(), InvalidField, Some("outcome")),
        (r#"{"op":"looked_up","run":"r","key":"k","outcome":"ok"}"#.into(), MissingField, Some("attempt")),
        (r#"{"op":"saga","run":"r","key":"k","action":"skip"}"#.into(), MissingField, Some("reason")),
        (r#"{"op":"saga","run":"r","key":"k","action":"skip","reason":"  "}"#.into(), MissingField, Some("reason")),
        (r#"{"op":"runs","limit":4294967296}"#.into(), InvalidField, Some("limit")),
        (r#"{"op":"runs","cursor":""}"#.into(), InvalidField, Some("cursor")),
        (r#"{"op":"runs","cursor":7}"#.into(), InvalidField, Some("cursor")),
        (r#"{"op":"pending","cursor":"r1"}"#.into(), InvalidField, Some("cursor")),
        (r#"{"op":"report","run":"r","cursor":"a\u0000"}"#.into(), InvalidField, Some("cursor")),
        (format!(r#"{{"op":"report","run":"r","cursor":"{}"}}"#, "k".repeat(1025)), InvalidField, Some("cursor")),
        (r#"{"op":"token","name":"a","role":"root"}"#.into(), InvalidField, Some("role")),
        (r#"{"op":"token","name":"","role":"agent"}"#.into(), InvalidField, Some("name")),
        (r#"{"op":"token","name":"a","role":"agent","groups":[""]}"#.into(), InvalidField, Some("groups")),
        (r#"{"op":"status","run":"a","run":"b"}"#.into(), InvalidField, Some("run")),
        (r#"{"op":"ping","id":true}"#.into(), InvalidField, Some("id")),
        (r#"{"op":"ping","id":{"n":1}}"#.into(), InvalidField, Some("id")),
        (format!(r#"{{"op":"ping","id":"{}"}}"#, "i".repeat(ID_BYTES_MAX)), InvalidField, Some("id")),
    ];
    for (line, code, field) in cases {
        refused(&line, code, field);
    }
    // line_too_long comes from the codec, which never hands the line over.
    let e = estop_protocol::RequestError::line_too_long(LINE_BYTES_MAX_DEFAULT);
    assert_eq!((e.code(), e.id), (ErrorCode::LineTooLong, Id::NULL));
}

#[test]
fn bounds_are_enforced_at_the_edge() {
    let at = |n: usize| "a".repeat(n);
    let admit = |extra: &str| {
        format!(r#"{{"op":"admit","run":"r","key":"k","tool":"t","args":{{}}{extra}}}"#)
    };
    // Labels: count, key and value sizes; the limits themselves pass.
    let labels = |n: usize, k: usize, v: usize| {
        let m: serde_json::Map<String, Value> = (0..n)
            .map(|i| {
                (
                    format!("{i:0>width$}", width = k.max(1)),
                    Value::from(at(v)),
                )
            })
            .collect();
        format!(r#","labels":{}"#, Value::Object(m))
    };
    ok(&admit(&labels(
        LABELS_MAX,
        LABEL_KEY_BYTES_MAX,
        LABEL_VALUE_BYTES_MAX,
    )));
    refused(
        &admit(&labels(LABELS_MAX + 1, 4, 1)),
        ErrorCode::InvalidField,
        Some("labels"),
    );
    refused(
        &admit(&labels(1, LABEL_KEY_BYTES_MAX + 1, 1)),
        ErrorCode::InvalidField,
        Some("labels"),
    );
    refused(
        &admit(&labels(1, 4, LABEL_VALUE_BYTES_MAX + 1)),
        ErrorCode::InvalidField,
        Some("labels"),
    );
    refused(
        &admit(r#","labels":{"":"x"}"#),
        ErrorCode::InvalidField,
        Some("labels"),
    );
    // Reasons, tokens, errors.
    ok(&format!(
        r#"{{"op":"cancel","run":"r","reason":"{}"}}"#,
        at(REASON_BYTES_MAX)
    ));
    refused(
        &format!(
            r#"{{"op":"cancel","run":"r","reason":"{}"}}"#,
            at(REASON_BYTES_MAX + 1)
        ),
        ErrorCode::InvalidField,
        Some("reason"),
    );
    refused(
        &format!(
            r#"{{"op":"kill","run":"r","reason":"{}"}}"#,
            at(REASON_BYTES_MAX + 1)
        ),
        ErrorCode::InvalidField,
        Some("reason"),
    );
    refused(
        &format!(r#"{{"op":"hello","token":"{}"}}"#, at(TOKEN_BYTES_MAX + 1)),
        ErrorCode::InvalidField,
        Some("token"),
    );
    refused(
        &format!(
            r#"{{"op":"complete","run":"r","key":"k","token":"t","outcome":"error","error":"{}"}}"#,
            at(ERROR_BYTES_MAX + 1)
        ),
        ErrorCode::InvalidField,
        Some("error"),
    );
    // Result: 64 KiB as sent.
    let result = |n: usize| {
        format!(
            r#"{{"op":"complete","run":"r","key":"k","token":"t","outcome":"ok","result":"{}"}}"#,
            at(n)
        )
    };
    ok(&result(RESULT_BYTES_MAX - 2));
    refused(
        &result(RESULT_BYTES_MAX - 1),
        ErrorCode::InvalidField,
        Some("result"),
    );
    // Groups.
    let groups: Vec<String> = (0..=GROUPS_MAX).map(|i| format!("g{i}")).collect();
    refused(
        &json!({"op": "token", "name": "a", "role": "operator", "groups": groups}).to_string(),
        ErrorCode::InvalidField,
        Some("groups"),
    );
}

#[test]
fn deep_nesting_is_refused_not_a_crash() {
    let deep = format!(
        r#"{{"op":"admit","run":"r","key":"k","tool":"t","args":{}1{}}}"#,
        "[".repeat(10_000),
        "]".repeat(10_000)
    );
    assert!(parse_request(deep.as_bytes()).is_err());
    let deep_unknown = format!(
        r#"{{"op":"ping","x":{}1{}}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    // Unknown fields are skipped without recursion, so this one is fine.
    assert_eq!(
        parse_request(deep_unknown.as_bytes()).map(|r| r.op),
        Ok(Op::Ping)
    );
    let deep_result = format!(
        r#"{{"op":"complete","run":"r","key":"k","token":"t","outcome":"ok","result":{}1{}}}"#,
        "[".repeat(1000),
        "]".repeat(1000)
    );
    refused(&deep_result, ErrorCode::InvalidField, Some("result"));
}

#[test]
fn secrets_stay_out_of_debug_output() {
    let r = ok(r#"{"op":"hello","token":"hunter2"}"#);
    assert!(!format!("{r:?}").contains("hunter2"));
}

const FIELDS: &[&str] = &[
    "id",
    "op",
    "run",
    "key",
    "tool",
    "args",
    "digest",
    "start",
    "parent",
    "labels",
    "needs_approval",
    "limits",
    "token",
    "outcome",
    "result",
    "error",
    "timeout_ms",
    "reason",
    "cascade",
    "decision",
    "state",
    "limit",
    "after",
    "name",
    "role",
    "groups",
    "zzz",
];

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        "[a-z0-9]{0,12}".prop_map(Value::from),
        prop::sample::select(vec![
            "r1",
            "k1",
            "ok",
            "approve",
            "agent",
            "paused",
            "completed"
        ])
        .prop_map(Value::from),
        prop::sample::select(Verb::ALL.iter().map(|v| v.as_str()).collect::<Vec<_>>())
            .prop_map(Value::from),
        Just(Value::from("ab".repeat(32))),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::btree_map("[a-z_]{1,6}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = parse_request(&bytes);
    }

    #[test]
    fn arbitrary_request_objects_never_panic(
        verb in prop::sample::select(Verb::ALL.to_vec()),
        fields in prop::collection::vec((prop::sample::select(FIELDS.to_vec()), json_value()), 0..10),
    ) {
        let mut m = serde_json::Map::new();
        m.insert("op".into(), verb.as_str().into());
        for (k, v) in fields {
            m.insert(k.to_string(), v);
        }
        let line = Value::Object(m).to_string();
        match parse_request(line.as_bytes()) {
            Ok(req) => {
                // Whatever parses renders back to the same request.
                let again = parse_request(&req.to_line());
                prop_assert_eq!(again, Ok(req));
            }
            Err(e) => {
                let reply: Value = serde_json::from_slice(&e.to_line()).expect("error replies are JSON");
                prop_assert_eq!(reply["error"]["code"].as_str(), Some(e.code().as_str()));
            }
        }
    }

    #[test]
    fn mutated_valid_lines_never_panic(cut in 0usize..120, flip in 0usize..120, byte in any::<u8>()) {
        let base = br#"{"id":1,"op":"admit","run":"r1","key":"k1","tool":"t","args":{"a":[1,2.5,"x"]},"labels":{"a":"b"}}"#;
        // One byte deleted, one byte overwritten.
        let mut line = base.to_vec();
        if cut < line.len() {
            line.remove(cut);
        }
        if let Some(b) = line.get_mut(flip) {
            *b = byte;
        }
        let _ = parse_request(&line);
        let _ = parse_request(&base[..cut.min(base.len())]);
    }
}

/// `admit`'s `declare`: the client's own word on how its call is undone, parsed into typed
/// values (round trip included) or refused naming the field.
#[test]
fn admit_declare_parses_and_bad_declarations_are_refused() {
    let line = r#"{"op":"admit","run":"r1","key":"k1","tool":"refund","args":{"to":"acct-1","amount":10},
        "declare":{"reversibility":"compensable","compensate":"reverse_refund","compensate_args":"{\"id\": result.id}"}}"#;
    let got = op(line);
    let expected = Op::Admit(Admit {
        declare: Some(estop_protocol::Declare {
            reversibility: Some(estop_kernel::vocab::Reversibility::Compensable),
            compensate: Some(tool("reverse_refund")),
            compensate_args: Some(r#"{"id": result.id}"#.into()),
        }),
        ..admit_base()
    });
    assert_eq!(got, expected);
    let req = Request::new(Id::from_u64(1), got);
    assert_eq!(ok(std::str::from_utf8(&req.to_line()).unwrap()), req);
    let base = r#"{"op":"admit","run":"r1","key":"k1","tool":"t","args":{},"declare":"#;
    for bad in [
        r#"{"reversibility":"undoable"}"#,
        r#"{"compensate":""}"#,
        r#"{"compensate":"x","surprise":1}"#,
        r#""reverse_refund""#,
    ] {
        refused(
            &format!("{base}{bad}}}"),
            ErrorCode::InvalidField,
            Some("declare"),
        );
    }
    let long = "x".repeat(estop_protocol::request::COMPENSATE_ARGS_BYTES_MAX + 1);
    refused(
        &format!(r#"{base}{{"compensate":"u","compensate_args":"{long}"}}}}"#),
        ErrorCode::InvalidField,
        Some("declare"),
    );
}

/// `admit`'s `seed`: a class and reversibility parsed into typed values (round trip included),
/// or refused naming the field when a value is not in the vocabulary or a key is unknown.
#[test]
fn admit_seed_parses_and_bad_seeds_are_refused() {
    let line = r#"{"op":"admit","run":"r1","key":"k1","tool":"refund","args":{"to":"acct-1","amount":10},
        "seed":{"class":"write","reversibility":"irreversible"}}"#;
    let got = op(line);
    let expected = Op::Admit(Admit {
        seed: Some(estop_protocol::Seed {
            class: Some(estop_kernel::vocab::EffectClass::Write),
            reversibility: Some(estop_kernel::vocab::Reversibility::Irreversible),
        }),
        ..admit_base()
    });
    assert_eq!(got, expected);
    let req = Request::new(Id::from_u64(1), got);
    assert_eq!(ok(std::str::from_utf8(&req.to_line()).unwrap()), req);
    let base = r#"{"op":"admit","run":"r1","key":"k1","tool":"t","args":{},"seed":"#;
    for bad in [
        r#"{"class":"delete"}"#,
        r#"{"reversibility":"undoable"}"#,
        r#"{"class":"read","action":"allow"}"#,
        r#""read""#,
    ] {
        refused(
            &format!("{base}{bad}}}"),
            ErrorCode::InvalidField,
            Some("seed"),
        );
    }
}
