//! Every way a policy file is refused, each with the line it points at.

use estop_kernel::vocab::{EffectClass, PolicyAction, Reversibility};
use estop_policy::{Policy, PolicyError};

/// Parses `text`, expects a refusal at `line` whose reason contains `needle`.
#[track_caller]
fn refused(text: &str, line: usize, needle: &str) {
    let err = match Policy::parse(text) {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(e) => e,
    };
    assert_eq!(err.code(), "policy_invalid");
    let PolicyError::Invalid {
        line: got, reason, ..
    } = &err
    else {
        panic!("{err:?}")
    };
    assert!(
        reason.contains(needle),
        "reason {reason:?} lacks {needle:?}"
    );
    assert_eq!(*got, line, "wrong line for {reason:?}");
    assert_eq!(err.line(), Some(line));
    assert!(
        err.to_string().starts_with(&format!("policy:{line}: ")),
        "{err}"
    );
}

/// A rule preceded by a harmless first rule, so line numbers are not all 1 or 2.
fn rule(body: &str) -> String {
    format!("# comment\n[[rules]]\ntool = \"first\"\naction = \"allow\"\n\n[[rules]]\n{body}")
}
// `rule(..)` puts the body's first line at line 7.

#[test]
fn empty_file_is_the_default_policy() {
    let p = Policy::parse("").unwrap();
    assert_eq!(p.rules_len(), 0);
    assert_eq!(p.defaults(), Policy::default().defaults());
}

#[test]
fn toml_syntax_error() {
    refused("[defaults]\nquorum = \n", 2, "");
    refused("[[rules]\n", 1, "");
}

#[test]
fn unknown_keys_are_refused() {
    refused("[defaults]\nqourum = 2\n", 2, "unknown field `qourum`");
    refused(
        &rule("tool = \"a\"\naction = \"allow\"\nqourum = 2\n"),
        9,
        "unknown field `qourum`",
    );
    refused("version = 1\n", 1, "unknown field `version`");
}

#[test]
fn missing_required_keys() {
    refused(&rule("action = \"allow\"\n"), 6, "missing field `tool`");
    refused(&rule("tool = \"a\"\n"), 6, "missing field `action`");
}

#[test]
fn bad_vocabulary() {
    refused(
        "[defaults]\nunknown_tool = \"alow\"\n",
        2,
        "unknown action \"alow\"; expected one of allow, approve, deny",
    );
    refused("[defaults]\nclass = \"rw\"\n", 2, "unknown class \"rw\"");
    refused(
        &rule("tool = \"a\"\naction = \"maybe\"\n"),
        8,
        "unknown action",
    );
    refused(
        &rule("tool = \"a\"\naction = \"allow\"\nclass = \"delete\"\n"),
        9,
        "unknown class",
    );
    refused(
        &rule("tool = \"a\"\naction = \"allow\"\nreversibility = \"undoable\"\n"),
        9,
        "unknown reversibility \"undoable\"; expected one of reversible, compensable, irreversible, undeclared",
    );
}

#[test]
fn bad_durations() {
    refused("[defaults]\napproval_expiry = \"15\"\n", 2, "needs a unit");
    refused("[defaults]\napproval_expiry = 15\n", 2, "not a bare number");
    refused(
        "[defaults]\n\nrun_deadline = \"1w\"\n",
        3,
        "unknown unit \"w\"",
    );
    refused("[defaults]\nrun_deadline = \"0s\"\n", 2, "is zero");
    refused(
        "[defaults]\nrun_deadline = \"400d\"\n",
        2,
        "longer than the limit of 365d",
    );
    refused(
        &rule("tool = \"a\"\naction = \"approve\"\nexpiry = \"ten minutes\"\n"),
        9,
        "bad duration",
    );
}

#[test]
fn bad_globs() {
    refused(
        &rule("tool = \"\"\naction = \"allow\"\n"),
        7,
        "`tool` is empty",
    );
    refused(
        &rule("tool = \"db_[rw]*\"\naction = \"allow\"\n"),
        7,
        "only `*`",
    );
    refused(
        &rule("tool = \"{a,b}\"\naction = \"allow\"\n"),
        7,
        "only `*`",
    );
    refused(
        &rule("tool = \"a\\tb\"\naction = \"allow\"\n"),
        7,
        "control character",
    );
    refused(
        &rule(&format!(
            "tool = \"{}\"\naction = \"allow\"\n",
            "x".repeat(201)
        )),
        7,
        "longer than the limit",
    );
}

#[test]
fn bad_when() {
    refused(
        &rule("tool = \"a\"\naction = \"deny\"\nwhen = \"args.amount >\"\n"),
        9,
        "does not compile",
    );
    refused(
        &rule("tool = \"a\"\naction = \"deny\"\nwhen = \"  \"\n"),
        9,
        "`when` is empty",
    );
    refused(
        &rule(&format!(
            "tool = \"a\"\naction = \"deny\"\nwhen = \"{}\"\n",
            "1 == 1 && ".repeat(500) + "true"
        )),
        9,
        "longer than the limit of 4096",
    );
    refused(
        &rule("tool = \"a\"\naction = \"deny\"\nwhen = 3\n"),
        9,
        "invalid type",
    );
}

#[test]
fn bad_quorum() {
    refused("[defaults]\nquorum = 0\n", 2, "`quorum` is 0");
    refused(
        &rule("tool = \"a\"\naction = \"approve\"\nquorum = 0\n"),
        9,
        "`quorum` is 0",
    );
    refused(
        &rule("tool = \"a\"\naction = \"approve\"\nquorum = -1\n"),
        9,
        "`quorum` is -1",
    );
    refused(
        &rule("tool = \"a\"\naction = \"approve\"\nquorum = 33\n"),
        9,
        "from 1 to 32",
    );
}

#[test]
fn quorum_smaller_than_groups() {
    // The explicit quorum is pointed at.
    refused(
        &rule("tool = \"a\"\naction = \"approve\"\nquorum = 1\ngroups = [\"finance\", \"ops\"]\n"),
        9,
        "quorum 1 is smaller than the 2 groups",
    );
    // With the default quorum, the groups are pointed at.
    refused(
        &rule("tool = \"a\"\naction = \"approve\"\ngroups = [\"finance\", \"ops\"]\n"),
        9,
        "so set quorum = 2 or more",
    );
    // A larger default quorum makes it fine.
    let text = format!(
        "[defaults]\nquorum = 2\n{}",
        rule("tool = \"a\"\naction = \"approve\"\ngroups = [\"finance\", \"ops\"]\n")
    );
    Policy::parse(&text).unwrap();
}

#[test]
fn bad_groups() {
    refused(
        &rule("tool = \"a\"\naction = \"approve\"\nquorum = 2\ngroups = [\"ops\", \"ops\"]\n"),
        10,
        "listed twice",
    );
    refused(
        &rule("tool = \"a\"\naction = \"approve\"\ngroups = [\"\"]\n"),
        9,
        "group name is empty",
    );
}

#[test]
fn approval_keys_on_other_actions() {
    refused(
        &rule("tool = \"a\"\naction = \"allow\"\nquorum = 2\n"),
        9,
        "`quorum` only applies to rules with action = \"approve\"",
    );
    refused(
        &rule("tool = \"a\"\naction = \"deny\"\ngroups = [\"ops\"]\n"),
        9,
        "`groups` only applies",
    );
    refused(
        &rule("tool = \"a\"\naction = \"allow\"\nexpiry = \"5m\"\n"),
        9,
        "`expiry` only applies",
    );
}

#[test]
fn bad_compensate() {
    refused(
        &rule("tool = \"a\"\naction = \"deny\"\ncompensate = \"undo_a\"\n"),
        9,
        "`compensate` on a deny rule",
    );
    refused(
        &rule(
            "tool = \"a\"\naction = \"allow\"\nreversibility = \"irreversible\"\n\ncompensate = \"undo_a\"\n",
        ),
        9,
        "drop one of them",
    );
    refused(
        &rule("tool = \"a\"\naction = \"allow\"\ncompensate = \"undo_*\"\n"),
        9,
        "names one tool, not a pattern",
    );
    refused(
        &rule("tool = \"a\"\naction = \"allow\"\ncompensate = \"\"\n"),
        9,
        "tool name is empty",
    );
}

#[test]
fn bad_compensate_args() {
    refused(
        &rule("tool = \"a\"\naction = \"allow\"\ncompensate_args = '{\"id\": result.id}'\n"),
        9,
        "`compensate_args` without `compensate`",
    );
    refused(
        &rule(
            "tool = \"a\"\naction = \"allow\"\ncompensate = \"undo_a\"\ncompensate_args = '{\"id\": '\n",
        ),
        10,
        "does not compile",
    );
    refused(
        &rule(
            "tool = \"a\"\naction = \"allow\"\ncompensate = \"undo_a\"\ncompensate_args = \" \"\n",
        ),
        10,
        "is empty",
    );
}

#[test]
fn bad_lookup() {
    refused(
        &rule("tool = \"a\"\naction = \"allow\"\nlookup = \"find_a\"\n"),
        9,
        "`lookup` without `compensate`",
    );
    refused(
        &rule("tool = \"a\"\naction = \"allow\"\ncompensate = \"undo_a\"\nlookup = \"find_*\"\n"),
        10,
        "bad `lookup` \"find_*\": it names one tool, not a pattern",
    );
    refused(
        &rule("tool = \"a\"\naction = \"allow\"\ncompensate = \"undo_a\"\nlookup_args = '{}'\n"),
        10,
        "`lookup_args` without `lookup`",
    );
    refused(
        &rule(
            "tool = \"a\"\naction = \"allow\"\ncompensate = \"undo_a\"\nlookup = \"find_a\"\nlookup_args = '{\"id\": '\n",
        ),
        11,
        "does not compile",
    );
}

/// An HTTP lookup goes to the forward request's own host with that host's credentials, so it
/// is refused where it could be anything else: on a tool that is not an HTTP request (whose
/// host is anything), on `CONNECT`, or without a `lookup_args` naming the path.
#[test]
fn an_http_lookup_only_looks_up_an_http_request_by_a_declared_path() {
    let http = |tool: &str, lookup: &str, args: &str| {
        rule(&format!(
            "tool = \"{tool}\"\naction = \"allow\"\ncompensate = \"http.DELETE\"\nlookup = \"{lookup}\"\n{args}"
        ))
    };
    let mapped = "lookup_args = '{\"path\": \"/orders?key=\" + idempotency_key}'\n";
    refused(
        &http("charge", "http.GET", mapped),
        10,
        "only looks up HTTP requests",
    );
    refused(
        &http("http.CONNECT", "http.GET", mapped),
        10,
        "only looks up HTTP requests",
    );
    refused(
        &http("http.POST", "http.CONNECT", mapped),
        10,
        "not a request an executor sends",
    );
    refused(
        &http("http.POST", "http.GET", ""),
        10,
        "needs `lookup_args`",
    );
    let p = Policy::parse(&http("http.POST", "http.GET", mapped)).unwrap();
    let tool = estop_kernel::ToolName::new("http.POST").unwrap();
    let v = p
        .evaluate(&tool, Some(&serde_json::json!({"host": "a"})), "agent")
        .unwrap();
    let source = v.lookup_args.expect("recorded");
    assert_eq!(&*source, r#"{"path": "/orders?key=" + idempotency_key}"#);
    let forward = serde_json::json!({"scheme": "https", "host": "api.test", "port": 8443});
    assert_eq!(
        estop_policy::lookup_args(&source, "http.POST", &forward, "idem:k1", "http.GET"),
        Ok(serde_json::json!({"url": "https://api.test:8443/orders?key=k1", "host": "api.test"}))
    );
    // The lookup goes to the forward request's origin, whatever the mapping would say.
    for (mapping, why) in [
        (
            r#"{"path": "/x", "url": "https://evil.test/"}"#,
            "gave \"url\"",
        ),
        (r#"{"path": "/x", "host": "evil.test"}"#, "gave \"host\""),
        (r#"{"path": "@evil.test/x"}"#, "no `path` starting with `/`"),
        (r#"{"path": "/x y"}"#, "not a request path"),
    ] {
        let e =
            estop_policy::lookup_args(mapping, "http.POST", &forward, "k", "http.GET").unwrap_err();
        assert!(e.contains(why), "{mapping}: {e}");
    }
    let v6 = serde_json::json!({"scheme": "http", "host": "::1", "port": 80});
    assert_eq!(
        estop_policy::lookup_args(
            r#"{"path": "/", "not_found": [404]}"#,
            "http.PUT",
            &v6,
            "k",
            "http.HEAD"
        )
        .unwrap()["url"],
        "http://[::1]:80/"
    );
    // A lookup of another tool may be mapped too (its executor gets the mapped arguments).
    let p = Policy::parse(&rule(
        "tool = \"charge\"\naction = \"allow\"\ncompensate = \"refund\"\nlookup = \"find\"\nlookup_args = '{\"ref\": args.id}'\n",
    ))
    .unwrap();
    let tool = estop_kernel::ToolName::new("charge").unwrap();
    let v = p
        .evaluate(&tool, Some(&serde_json::json!({"id": 3})), "agent")
        .unwrap();
    assert_eq!(
        estop_policy::lookup_args(
            &v.lookup_args.unwrap(),
            "charge",
            &serde_json::json!({"id": 3}),
            "k",
            "find"
        ),
        Ok(serde_json::json!({"ref": 3}))
    );
}

/// A rule's `lookup` reaches the ruling (and so the admission's record).
#[test]
fn lookup_is_recorded() {
    let p = Policy::parse(
        "[[rules]]\ntool = \"charge\"\naction = \"allow\"\ncompensate = \"refund\"\nlookup = \"find_charge\"\n",
    )
    .unwrap();
    let tool = estop_kernel::ToolName::new("charge").unwrap();
    let v = p
        .evaluate(&tool, Some(&serde_json::json!({})), "agent")
        .unwrap();
    assert_eq!(v.lookup.as_ref().map(|t| t.as_str()), Some("find_charge"));
}

/// A rule's `compensate_args` reaches the verdict as written, so the admission records it and
/// the saga evaluates exactly that text later, whatever the policy file says by then.
#[test]
fn compensate_args_is_recorded_as_written() {
    let text = r#"
[[rules]]
tool = "refund"
action = "allow"
compensate = "reverse_refund"
compensate_args = '{"charge": result.id, "amount": args.amount}'
"#;
    let p = Policy::parse(text).unwrap();
    let tool = estop_kernel::ToolName::new("refund").unwrap();
    let v = p
        .evaluate(&tool, Some(&serde_json::json!({"amount": 5})), "agent")
        .unwrap();
    let source = v.compensate_args.expect("recorded");
    assert_eq!(&*source, r#"{"charge": result.id, "amount": args.amount}"#);
    assert_eq!(
        estop_policy::compensation_args(
            &source,
            "refund",
            &serde_json::json!({"amount": 5}),
            Some(r#"{"id":"ch_9"}"#)
        ),
        Ok(serde_json::json!({"charge": "ch_9", "amount": 5}))
    );
}

#[test]
fn bad_names() {
    refused(
        &rule("tool = \"a\"\naction = \"allow\"\nname = \"unknown_tool\"\n"),
        9,
        "reserved",
    );
    refused(
        &rule("tool = \"a\"\naction = \"allow\"\nname = \"default\"\n"),
        9,
        "reserved",
    );
    refused(
        &rule("tool = \"a\"\naction = \"allow\"\nname = \"\"\n"),
        9,
        "`name` is empty",
    );
    refused(
        "[[rules]]\ntool = \"a\"\naction = \"allow\"\nname = \"x\"\n[[rules]]\ntool = \"b\"\naction = \"allow\"\nname = \"x\"\n",
        8,
        "two rules are named \"x\" (the other is at line 1)",
    );
    // A given name may not collide with another rule's default name either.
    refused(
        "[[rules]]\ntool = \"a\"\naction = \"allow\"\n[[rules]]\ntool = \"b\"\naction = \"allow\"\nname = \"rule 1\"\n",
        7,
        "two rules are named \"rule 1\"",
    );
}

#[test]
fn unreachable_rules() {
    refused(
        &rule("tool = \"first\"\naction = \"deny\"\n"),
        7,
        "can never match: rule \"rule 1\" (line 2)",
    );
    refused(
        "[[rules]]\ntool = \"*\"\naction = \"approve\"\n[[rules]]\ntool = \"refund\"\naction = \"deny\"\n",
        5,
        "can never match",
    );
    // A conditional rule shadows nothing.
    Policy::parse("[[rules]]\ntool = \"*\"\nwhen = \"true\"\naction = \"approve\"\n[[rules]]\ntool = \"refund\"\naction = \"deny\"\n").unwrap();
}

#[test]
fn bad_max_effects() {
    refused("[defaults]\nmax_effects = 0\n", 2, "`max_effects` is 0");
    refused("[defaults]\nmax_effects = -5\n", 2, "at least 1");
}

#[test]
fn too_many_rules() {
    let mut text = String::new();
    for i in 0..=estop_policy::RULES_MAX {
        text.push_str(&format!("[[rules]]\ntool = \"t{i}\"\naction = \"allow\"\n"));
    }
    refused(
        &text,
        3 * estop_policy::RULES_MAX + 1,
        "more than the limit of 10000",
    );
}

#[test]
fn the_largest_policy_loads() {
    let mut text = String::new();
    for i in 0..estop_policy::RULES_MAX {
        let when = if i % 200 == 0 {
            "when = \"args.n > 1\"\n"
        } else {
            ""
        };
        text.push_str(&format!(
            "[[rules]]\ntool = \"t{i}*\"\n{when}action = \"allow\"\n"
        ));
    }
    assert_eq!(
        Policy::parse(&text).unwrap().rules_len(),
        estop_policy::RULES_MAX
    );
}

#[test]
fn too_large() {
    let text = format!("# {}\n", "x".repeat(estop_policy::POLICY_BYTES_MAX));
    refused(&text, 1, "larger than the limit");
}

#[test]
fn load_reads_a_file_and_names_it_in_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.toml");
    std::fs::write(
        &path,
        "[[rules]]\ntool = \"search*\"\naction = \"allow\"\nclass = \"read\"\n",
    )
    .unwrap();
    let p = Policy::load(&path).unwrap();
    assert_eq!(p.rules_len(), 1);

    std::fs::write(&path, "[defaults]\nquorum = 0\n").unwrap();
    let err = Policy::load(&path).unwrap_err();
    assert_eq!(err.line(), Some(2));
    assert!(
        err.to_string()
            .starts_with(&format!("{}:2: ", path.display())),
        "{err}"
    );

    let missing = dir.path().join("nope.toml");
    let err = Policy::load(&missing).unwrap_err();
    assert_eq!(err.code(), "policy_unreadable");
    assert_eq!(err.line(), None);
    assert!(err.to_string().contains("nope.toml"), "{err}");
}

#[test]
fn every_key_of_the_format() {
    let text = r#"
[defaults]
unknown_tool = "deny"
approval_expiry = "1h30m"
quorum = 2
class = "read"
run_deadline = "24h"
max_effects = 10000

[[rules]]
tool = "search*"
action = "allow"

[[rules]]
tool = "refund"
when = "args.amount > 100"
action = "approve"
quorum = 3
groups = ["finance", "ops"]
expiry = "10m"
class = "write"
reversibility = "compensable"
compensate = "reverse_refund"
name = "big-refunds"
"#;
    let p = Policy::parse(text).unwrap();
    let d = p.defaults();
    assert_eq!(d.unknown_tool, PolicyAction::Deny);
    assert_eq!(d.approval_expiry_ms, 90 * 60 * 1000);
    assert_eq!(d.quorum, 2);
    assert_eq!(d.class, EffectClass::Read);
    assert_eq!(d.run_deadline_ms, Some(24 * 3600 * 1000));
    assert_eq!(d.run_effects_max, Some(10000));
    assert_eq!(p.rules_len(), 2);
    let _ = Reversibility::Compensable;
}
