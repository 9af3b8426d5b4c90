//! `Fields` (a request from named values: the HTTP API's body, query and path) against the
//! line parser: a request assembled from values is the request, or the refusal, that one line
//! holding the same values gives. This is what the console did before it built typed requests
//! (it merged the values into a JSON object and parsed that), so it pins that nothing changed.

use estop_protocol::{Fields, Request, RequestError, Verb, parse_request};
use proptest::prelude::*;
use serde_json::{Map, Value};

/// Every field name a verb reads, `op`, and one no verb reads.
const NAMES: &[&str] = &[
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
    "cursor",
    "name",
    "role",
    "groups",
    "zzz",
];

/// Texts that are valid somewhere, invalid elsewhere, or refused everywhere.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "",
            "r1",
            "k1",
            "5",
            "0",
            "abc",
            "false",
            "true",
            "null",
            "approve",
            "reject",
            "failed",
            "completed",
            "active",
            "agent",
            "observer",
            "1.1",
            "r1\u{202e}x",
            "99999999999999999999",
            "4294967296",
            "bob",
        ])
        .prop_map(String::from),
        "[a-z0-9._:-]{0,12}",
        Just("x".repeat(300)),
        Just("ab".repeat(32)),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        prop::sample::select(vec![0u64, 5, 1000, 4_294_967_296, u64::MAX]).prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        Just(Value::from(1.5)),
        text().prop_map(Value::from),
    ];
    leaf.prop_recursive(2, 12, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Value::from),
            prop::collection::btree_map("[a-z_]{1,6}", inner, 0..3)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// What the console did before: one JSON object, the body's fields, then the query's (numbers
/// for `limit` and `after` when they read as one), then `op`, then the path's, parsed as a line.
fn as_line(
    verb: Verb,
    body: &Map<String, Value>,
    query: &[(&str, String)],
    path: &[(&str, String)],
) -> Result<Request, RequestError> {
    let mut obj = body.clone();
    for (k, v) in query {
        let number = ["limit", "after"]
            .contains(k)
            .then(|| v.parse::<u64>().ok())
            .flatten();
        obj.insert(
            k.to_string(),
            number.map_or_else(|| Value::from(v.as_str()), Value::from),
        );
    }
    obj.insert("op".into(), verb.as_str().into());
    for (k, v) in path {
        obj.insert(k.to_string(), Value::from(v.as_str()));
    }
    parse_request(Value::Object(obj).to_string().as_bytes())
}

fn as_fields(
    verb: Verb,
    body: &Map<String, Value>,
    query: &[(&str, String)],
    path: &[(&str, String)],
) -> Result<Request, RequestError> {
    let mut f = Fields::new();
    for (k, v) in body {
        f.json(k, v);
    }
    for (k, v) in query {
        match ["limit", "after"]
            .contains(k)
            .then(|| v.parse::<u64>().ok())
            .flatten()
        {
            Some(n) => f.number(k, n),
            None => f.text(k, v),
        }
    }
    for (k, v) in path {
        f.text(k, v);
    }
    f.build(verb)
}

/// Keys given once each (as in a map of query parameters, or a path).
fn named(names: Vec<(&'static str, String)>) -> Vec<(&'static str, String)> {
    let mut seen = std::collections::BTreeMap::new();
    for (k, v) in names {
        seen.insert(k, v);
    }
    seen.into_iter().collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn fields_build_what_the_same_line_parses_to(
        verb in prop::sample::select(Verb::ALL.to_vec()),
        body in prop::collection::btree_map(prop::sample::select(NAMES.to_vec()), json_value(), 0..6),
        query in prop::collection::vec((prop::sample::select(NAMES.to_vec()), text()), 0..4),
        // The console's path segments never name `op` (its routes name the verb).
        path in prop::collection::vec((prop::sample::select(NAMES[2..].to_vec()), text()), 0..3),
    ) {
        let body: Map<String, Value> = body.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        let (query, path) = (named(query), named(path));
        prop_assert_eq!(
            as_fields(verb, &body, &query, &path),
            as_line(verb, &body, &query, &path)
        );
    }
}

/// Names and values, as a test writes them.
type Named<'a> = &'a [(&'a str, &'a str)];

fn owned<'a>(kv: &[(&'a str, &str)]) -> Vec<(&'a str, String)> {
    kv.iter().map(|(k, v)| (*k, v.to_string())).collect()
}

/// The console's requests, one by one: the same request or the same refusal as the line.
#[test]
fn console_requests_match_their_lines() {
    let cases: &[(Verb, &str, Named, Named)] = &[
        (Verb::Runs, "", &[("limit", "x")], &[]),
        (Verb::Runs, "", &[("limit", "5"), ("state", "paused")], &[]),
        (Verb::Ledger, "", &[("run", "123"), ("limit", "5")], &[]),
        (
            Verb::Cancel,
            r#"{"reason": "stop now", "cascade": false}"#,
            &[],
            &[("run", "r")],
        ),
        (Verb::Cancel, r#"{"reason": 5}"#, &[], &[("run", "r")]),
        (
            Verb::Cancel,
            r#"{"run": 5, "reason": "x"}"#,
            &[],
            &[("run", "r")],
        ),
        (Verb::Cancel, "", &[("cascade", "false")], &[("run", "r")]),
        (
            Verb::Decide,
            r#"{"reason": "ok", "zzz": [1]}"#,
            &[],
            &[("run", "r"), ("key", "k"), ("decision", "approve")],
        ),
        (
            Verb::Decide,
            r#"{"decision": "maybe"}"#,
            &[],
            &[("run", "r"), ("key", "k")],
        ),
        (
            Verb::Close,
            r#"{"outcome": "failed", "id": {"no": 1}}"#,
            &[],
            &[("run", "r")],
        ),
        (
            Verb::Token,
            r#"{"name": "bob", "role": "agent", "groups": ["a", 1]}"#,
            &[],
            &[],
        ),
        (
            Verb::Token,
            r#"{"name": "bob", "role": "agent", "groups": ["a"]}"#,
            &[("groups", "b")],
            &[],
        ),
        (Verb::TokenRevoke, "", &[], &[("name", "bob\u{202e}")]),
        (Verb::Pending, "", &[("cursor", "nope")], &[]),
    ];
    for (verb, body, query, path) in cases {
        let body: Map<String, Value> = if body.is_empty() {
            Map::new()
        } else {
            serde_json::from_str(body).unwrap()
        };
        let (query, path) = (owned(query), owned(path));
        assert_eq!(
            as_fields(*verb, &body, &query, &path),
            as_line(*verb, &body, &query, &path),
            "{verb} {body:?} {query:?} {path:?}"
        );
    }
}
