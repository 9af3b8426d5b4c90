//! Evaluation semantics: first match wins, defaults, conditions, numbers, digest-only admits,
//! fail-closed conditions and strengthening.

use estop_kernel::ids::ToolName;
use estop_kernel::vocab::{EffectClass, PolicyAction, Reversibility};
use estop_policy::{EvalError, Policy, Ruling};
use serde_json::{Value, json};

fn tool(name: &str) -> ToolName {
    ToolName::new(name).unwrap()
}

fn eval(p: &Policy, name: &str, args: Value) -> Result<Ruling, EvalError> {
    p.evaluate(&tool(name), Some(&args), "agent")
}

/// The action and deciding rule for a call, or the error code and rule.
fn decide(p: &Policy, name: &str, args: Value) -> String {
    match eval(p, name, args) {
        Ok(v) => format!("{} by {}", v.action, v.rule),
        Err(e) => format!("{} in {}", e.code(), e.rule()),
    }
}

const REFUNDS: &str = r#"
[defaults]
approval_expiry = "20m"

[[rules]]
tool = "search*"
action = "allow"
class = "read"

[[rules]]
tool = "refund"
when = "args.amount > 100"
action = "approve"
quorum = 2
groups = ["finance", "ops"]
expiry = "10m"
compensate = "reverse_refund"
name = "big-refunds"

[[rules]]
tool = "refund"
action = "allow"
reversibility = "compensable"
compensate = "reverse_refund"

[[rules]]
tool = "drop_*"
action = "deny"
"#;

#[test]
fn first_matching_rule_wins() {
    let p = Policy::parse(REFUNDS).unwrap();
    assert_eq!(decide(&p, "search_web", json!({})), "allow by rule 1");
    assert_eq!(
        decide(&p, "refund", json!({"amount": 500})),
        "approve by big-refunds"
    );
    assert_eq!(
        decide(&p, "refund", json!({"amount": 5})),
        "allow by rule 3"
    );
    assert_eq!(decide(&p, "drop_table", json!({})), "deny by rule 4");
    assert_eq!(
        decide(&p, "send_email", json!({})),
        "approve by unknown_tool"
    );
}

#[test]
fn verdict_carries_the_rule() {
    let p = Policy::parse(REFUNDS).unwrap();
    let v = eval(&p, "refund", json!({"amount": 500})).unwrap();
    assert_eq!(
        v,
        Ruling {
            action: PolicyAction::Approve,
            class: EffectClass::Write,
            class_by_rule: false,
            reversibility: Reversibility::Compensable,
            compensate: Some(tool("reverse_refund")),
            compensate_args: None,
            lookup: None,
            lookup_args: None,
            quorum: 2,
            groups: vec!["finance".into(), "ops".into()],
            expiry_ms: 10 * 60 * 1000,
            rule: "big-refunds".into(),
            matched: true,
            conditional: true,
            strengthened: false,
        }
    );
    let v = eval(&p, "search", json!({})).unwrap();
    assert_eq!(
        (v.class, v.reversibility, v.conditional, v.quorum),
        (EffectClass::Read, Reversibility::Undeclared, false, 1)
    );
    assert_eq!(
        v.expiry_ms,
        20 * 60 * 1000,
        "allow rulings carry the default expiry for strengthening"
    );
}

#[test]
fn unknown_tools_get_the_default_action_as_writes() {
    let p = Policy::parse(
        "[defaults]\nclass = \"read\"\nquorum = 2\n[[rules]]\ntool = \"a\"\naction = \"allow\"\n",
    )
    .unwrap();
    let v = eval(&p, "b", json!({})).unwrap();
    assert_eq!(
        (v.action, v.class, v.reversibility),
        (
            PolicyAction::Approve,
            EffectClass::Write,
            Reversibility::Undeclared
        )
    );
    assert_eq!((&*v.rule, v.matched, v.quorum), ("unknown_tool", false, 2));
    // defaults.class applies to rules that do not say.
    assert_eq!(eval(&p, "a", json!({})).unwrap().class, EffectClass::Read);

    let p = Policy::parse(
        "[defaults]\nunknown_tool = \"deny\"\n[[rules]]\ntool = \"a\"\naction = \"allow\"\n",
    )
    .unwrap();
    assert_eq!(decide(&p, "b", json!({})), "deny by unknown_tool");
}

#[test]
fn default_and_allow_all() {
    let v = Policy::default()
        .evaluate(&tool("anything"), None, "agent")
        .unwrap();
    assert_eq!(
        (v.action, v.quorum, v.expiry_ms),
        (PolicyAction::Approve, 1, 15 * 60 * 1000)
    );
    assert_eq!((&*v.rule, v.matched), ("default", false));

    let v = Policy::allow_all()
        .evaluate(&tool("anything"), None, "agent")
        .unwrap();
    assert_eq!(
        (v.action, v.class),
        (PolicyAction::Allow, EffectClass::Write)
    );
}

#[test]
fn default_quorum_applies_to_approve_rules_only() {
    let p = Policy::parse("[defaults]\nquorum = 3\n[[rules]]\ntool = \"a\"\naction = \"approve\"\n[[rules]]\ntool = \"b\"\naction = \"allow\"\n").unwrap();
    assert_eq!(eval(&p, "a", json!({})).unwrap().quorum, 3);
    assert_eq!(eval(&p, "b", json!({})).unwrap().quorum, 1);
}

#[test]
fn compensate_implies_compensable() {
    let p = Policy::parse("[[rules]]\ntool = \"a\"\naction = \"allow\"\ncompensate = \"undo_a\"\n[[rules]]\ntool = \"b\"\naction = \"allow\"\nreversibility = \"reversible\"\ncompensate = \"undo_b\"\n").unwrap();
    assert_eq!(
        eval(&p, "a", json!({})).unwrap().reversibility,
        Reversibility::Compensable
    );
    assert_eq!(
        eval(&p, "b", json!({})).unwrap().reversibility,
        Reversibility::Reversible
    );
}

fn when(expr: &str) -> Policy {
    let text = format!(
        "[[rules]]\ntool = \"*\"\nwhen = '''{expr}'''\naction = \"deny\"\nname = \"cond\"\n[[rules]]\ntool = \"*\"\naction = \"allow\"\n"
    );
    Policy::parse(&text).unwrap()
}

/// Whether `expr` holds for `args` (tool `refund`, principal `agent`).
#[track_caller]
fn holds(expr: &str, args: Value) -> bool {
    match eval(&when(expr), "refund", args).unwrap().action {
        PolicyAction::Deny => true,
        PolicyAction::Allow => false,
        other => panic!("{other}"),
    }
}

#[test]
fn numbers_compare_as_numbers_whether_integer_or_float() {
    assert!(holds("args.amount > 100", json!({"amount": 100.5})));
    assert!(holds("args.amount > 100", json!({"amount": 101})));
    assert!(!holds("args.amount > 100", json!({"amount": 100})));
    assert!(!holds("args.amount > 100", json!({"amount": 100.0})));
    assert!(!holds("args.amount > 100", json!({"amount": 99.9})));
    assert!(holds("args.amount > 100.0", json!({"amount": 101})));
    assert!(!holds("args.amount > 100.0", json!({"amount": 100})));
    assert!(holds("args.amount >= 100", json!({"amount": 100})));
    assert!(holds("args.amount >= 100", json!({"amount": 100.0})));
    assert!(holds("args.amount >= 100.0", json!({"amount": 100})));
    assert!(holds("args.amount < 100", json!({"amount": 99.9})));
    assert!(holds("args.amount <= 100", json!({"amount": 100.0})));
    assert!(holds("args.amount == 100", json!({"amount": 100.0})));
    assert!(holds("args.amount != 100", json!({"amount": 100.5})));
    assert!(holds("args.amount > -1", json!({"amount": 0})));
    // Above i64::MAX the JSON integer is a uint, still comparable.
    assert!(holds(
        "args.id > 9223372036854775807",
        json!({"id": 18446744073709551615u64})
    ));
    assert!(holds(
        "args.amount in [1, 100, 7]",
        json!({"amount": 100.0})
    ));
    // Large integers stay exact integers: no rounding through a double.
    assert!(!holds(
        "args.id == 9007199254740993",
        json!({"id": 9007199254740992i64})
    ));
    // Arithmetic within one kind works; across kinds use double().
    assert!(holds("args.qty * 2 > 10", json!({"qty": 6})));
    assert!(holds(
        "double(args.amount) * 2.0 > 10.0",
        json!({"amount": 6})
    ));
    assert!(holds(
        "double(args.amount) * 2.0 > 10.0",
        json!({"amount": 5.5})
    ));
}

#[test]
fn variables_and_functions() {
    assert!(holds(
        "args.customer.tier == \"gold\"",
        json!({"customer": {"tier": "gold"}})
    ));
    assert!(!holds(
        "args.customer.tier == \"gold\"",
        json!({"customer": {"tier": "silver"}})
    ));
    assert!(holds("principal == \"agent\"", json!({})));
    assert!(holds("tool.startsWith(\"re\")", json!({})));
    assert!(holds("tool == \"refund\"", json!({})));
    assert!(holds("\"x\" in args", json!({"x": 1})));
    assert!(!holds("\"x\" in args", json!({"y": 1})));
    assert!(holds("has(args.x)", json!({"x": null})));
    assert!(!holds("has(args.x)", json!({})));
    assert!(holds("has(args.x) && args.x > 1", json!({"x": 2})));
    assert!(!holds("has(args.x) && args.x > 1", json!({})));
    assert!(holds(
        "args.to.endsWith(\"@example.com\")",
        json!({"to": "a@example.com"})
    ));
    assert!(holds(
        "args.path.matches(\"^/etc/\")",
        json!({"path": "/etc/passwd"})
    ));
    assert!(holds("args.flag", json!({"flag": true})));
    assert!(holds("args.note == null", json!({"note": null})));
    // The standard functions docs/POLICY.md lists.
    assert!(holds(
        "string(args.n) == \"5\" && uint(args.n) == 5u && int(args.f) == 2",
        json!({"n": 5, "f": 2.7})
    ));
    assert!(holds(
        "args.items.exists_one(x, x > 1) ? args.s.contains(\"b\") : false",
        json!({"items": [1, 2], "s": "abc"})
    ));
    assert!(holds(
        "args.items.filter(x, x > 1).size() == 1 && args.items.map(x, x * 2)[1] == 4",
        json!({"items": [1, 2]})
    ));
}

#[test]
fn lists() {
    assert!(holds("size(args.items) > 2", json!({"items": [1, 2, 3]})));
    assert!(holds(
        "\"admin\" in args.roles",
        json!({"roles": ["user", "admin"]})
    ));
    assert!(holds(
        "args.items.exists(i, i.price > 100)",
        json!({"items": [{"price": 5}, {"price": 150.5}]})
    ));
    assert!(!holds(
        "args.items.all(i, i.price > 100)",
        json!({"items": [{"price": 5}, {"price": 150.5}]})
    ));
    assert!(holds("args.items[0] == 1", json!({"items": [1.0, 2]})));
}

#[test]
fn a_false_condition_falls_through() {
    let p = Policy::parse(REFUNDS).unwrap();
    let v = eval(&p, "refund", json!({"amount": 100})).unwrap();
    assert_eq!(
        (v.action, &*v.rule, v.conditional),
        (PolicyAction::Allow, "rule 3", true)
    );
}

#[test]
fn digest_only_admits_of_conditional_tools_are_refused() {
    let p = Policy::parse(REFUNDS).unwrap();
    let err = p.evaluate(&tool("refund"), None, "agent").unwrap_err();
    assert_eq!(
        err,
        EvalError::ArgsRequired {
            tool: "refund".into(),
            rule: "big-refunds".into()
        }
    );
    assert_eq!(err.code(), "policy_args_required");
    assert!(err.to_string().contains("send the call's `args`"), "{err}");
    // Tools without conditional rules need no arguments.
    let v = p.evaluate(&tool("search"), None, "agent").unwrap();
    assert!(!v.conditional);
    assert_eq!(
        p.evaluate(&tool("drop_x"), None, "agent").unwrap().action,
        PolicyAction::Deny
    );
    assert_eq!(
        &*p.evaluate(&tool("other"), None, "agent").unwrap().rule,
        "unknown_tool"
    );
}

#[test]
fn a_conditional_rule_after_the_match_still_requires_args() {
    // SPEC §3: refused when *any* rule for the tool has a `when`, even one after the match.
    let text = "[[rules]]\ntool = \"refund\"\naction = \"approve\"\n[[rules]]\ntool = \"re*\"\nwhen = \"args.amount > 1\"\naction = \"deny\"\nname = \"later\"\n[[rules]]\ntool = \"x\"\naction = \"allow\"\n";
    let p = Policy::parse(text).unwrap();
    let err = p.evaluate(&tool("refund"), None, "agent").unwrap_err();
    assert_eq!(
        err,
        EvalError::ArgsRequired {
            tool: "refund".into(),
            rule: "later".into()
        }
    );
    let v = eval(&p, "refund", json!({"amount": 5})).unwrap();
    assert_eq!(
        (v.action, &*v.rule, v.conditional),
        (PolicyAction::Approve, "rule 1", true)
    );
    // A later conditional rule for another tool does not matter.
    let v = p.evaluate(&tool("x"), None, "agent").unwrap();
    assert!(!v.conditional);
}

#[test]
fn conditions_that_fail_to_evaluate_fail_closed_and_name_the_rule() {
    for (expr, args, needle) in [
        ("args.amount > 100", json!({}), "No such key: amount"),
        (
            "args.amount > 100",
            json!({"amount": "lots"}),
            "no matching overload",
        ),
        ("args.amount", json!({"amount": 5}), "not a bool"),
        (
            "args.amount + 1 > 100",
            json!({"amount": 100.5}),
            "wrap them in double",
        ),
        (
            "arg.amount > 1",
            json!({}),
            "the variables are tool, args and principal",
        ),
        ("args.amount > 100", json!([1, 2]), ""),
        ("args.amount > 100", json!("text"), ""),
        ("args.a / args.b > 1", json!({"a": 1, "b": 0}), "zero"),
    ] {
        let err = eval(&when(expr), "refund", args.clone()).unwrap_err();
        let EvalError::WhenFailed { rule, message } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(rule, "cond", "{expr}");
        assert!(
            message.contains(needle),
            "{expr} with {args}: {message:?} lacks {needle:?}"
        );
        assert_eq!(err.code(), "policy_when_failed");
        assert!(err.to_string().contains("refused"), "{err}");
    }
}

#[test]
fn default_rule_names_count_from_one() {
    let p = Policy::parse("[[rules]]\ntool = \"a\"\naction = \"allow\"\n[[rules]]\ntool = \"*\"\nwhen = \"args.x\"\naction = \"deny\"\n").unwrap();
    assert_eq!(eval(&p, "b", json!({})).unwrap_err().rule(), "rule 2");
}

#[test]
fn overly_deep_args_fail_closed() {
    let mut args = json!(1);
    for _ in 0..200 {
        args = json!({ "a": args });
    }
    let err = eval(&when("has(args.a)"), "refund", args).unwrap_err();
    assert!(
        matches!(&err, EvalError::WhenFailed { message, .. } if message.contains("deeper than 128")),
        "{err}"
    );
}

#[test]
fn error_messages_are_bounded() {
    let big = "x".repeat(10_000);
    let err = eval(&when("args.s"), "refund", json!({ "s": big })).unwrap_err();
    let EvalError::WhenFailed { message, .. } = err else {
        panic!()
    };
    assert!(message.len() < 1000, "{}", message.len());
}

#[test]
fn strengthening_turns_allow_into_approve_and_never_weakens() {
    let p = Policy::parse(REFUNDS).unwrap();

    let mut v = eval(&p, "search", json!({})).unwrap();
    v.strengthen(false);
    assert_eq!((v.action, v.strengthened), (PolicyAction::Allow, false));
    v.strengthen(true);
    assert_eq!(
        (v.action, v.quorum, v.expiry_ms, v.strengthened),
        (PolicyAction::Approve, 1, 20 * 60 * 1000, true)
    );
    assert!(v.groups.is_empty());
    assert_eq!(&*v.rule, "rule 1", "the deciding rule is kept");

    let mut v = eval(&p, "refund", json!({"amount": 500})).unwrap();
    let before = v.clone();
    v.strengthen(true);
    assert_eq!(v, before, "approve keeps its quorum, groups and expiry");
    v.strengthen(false);
    assert_eq!(v, before, "approve cannot be weakened");

    let mut v = eval(&p, "drop_table", json!({})).unwrap();
    v.strengthen(true);
    assert_eq!(v.action, PolicyAction::Deny);
    v.strengthen(false);
    assert_eq!(v.action, PolicyAction::Deny);
}

#[test]
fn evaluation_is_deterministic_and_shareable() {
    let p = std::sync::Arc::new(Policy::parse(REFUNDS).unwrap());
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let p = std::sync::Arc::clone(&p);
            std::thread::spawn(move || {
                eval(&p, "refund", json!({"amount": 99 + i}))
                    .unwrap()
                    .rule
                    .to_string()
            })
        })
        .collect();
    let rules: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(rules, ["rule 3", "rule 3", "big-refunds", "big-refunds"]);
}

#[test]
fn converts_into_the_kernel_decision_and_run_limits() {
    let p = Policy::parse(REFUNDS).unwrap();
    let mut v = eval(&p, "search", json!({})).unwrap();
    v.strengthen(true);
    let d = estop_kernel::PolicyDecision::from(v);
    assert_eq!(
        (d.action, d.quorum, &*d.rule),
        (PolicyAction::Approve, 1, "rule 1")
    );
    let d = estop_kernel::PolicyDecision::from(eval(&p, "refund", json!({"amount": 500})).unwrap());
    assert_eq!(d.groups, vec!["finance".into(), "ops".into()]);
    assert_eq!(d.compensate, Some(tool("reverse_refund")));

    let limits = p.run_limits(1_000);
    assert_eq!((limits.deadline_at, limits.max_effects), (None, None));
    let p = Policy::parse("[defaults]\nrun_deadline = \"1s\"\nmax_effects = 7\n").unwrap();
    let limits = p.run_limits(1_000);
    assert_eq!(
        (limits.deadline_at, limits.max_effects),
        (Some(2_000), Some(7))
    );
    assert_eq!(p.run_limits(u64::MAX).deadline_at, Some(u64::MAX));
}

/// A client's declaration at admit time may only add to what policy says.
#[test]
fn a_client_declaration_adds_and_never_takes_away() {
    use estop_policy::Declared;
    let p = Policy::parse(
        r#"
[[rules]]
tool = "refund"
action = "allow"
compensate = "reverse_refund"

[[rules]]
tool = "email"
action = "allow"
reversibility = "irreversible"

[[rules]]
tool = "*"
action = "allow"
name = "rest"
"#,
    )
    .unwrap();
    let verdict = |t: &str| p.evaluate(&tool(t), Some(&json!({})), "agent").unwrap();
    let declared = |comp: Option<&str>, args: Option<&str>, rev: Option<Reversibility>| Declared {
        reversibility: rev,
        compensate: comp.map(tool),
        compensate_args: args.map(str::to_string),
    };

    // Where policy said nothing, the client's word is recorded (a tool makes it compensable).
    let mut v = verdict("book");
    assert_eq!(v.reversibility, Reversibility::Undeclared);
    v.declare(&declared(
        Some("unbook"),
        Some(r#"{"id": result.id}"#),
        None,
    ))
    .unwrap();
    assert_eq!(v.compensate, Some(tool("unbook")));
    assert_eq!(v.reversibility, Reversibility::Compensable);
    assert_eq!(v.compensate_args.as_deref(), Some(r#"{"id": result.id}"#));

    // Policy's compensation stays: the same tool is fine, a mapping may be added.
    let mut v = verdict("refund");
    v.declare(&declared(
        Some("reverse_refund"),
        Some(r#"{"a": args}"#),
        None,
    ))
    .unwrap();
    assert_eq!(v.compensate, Some(tool("reverse_refund")));
    let before = verdict("refund");
    // Each refusal leaves the verdict as it was.
    for (d, needle) in [
        (
            declared(Some("other"), None, None),
            "cannot replace it with other",
        ),
        (
            declared(None, None, Some(Reversibility::Irreversible)),
            "cannot declare it irreversible",
        ),
        (declared(Some("undo_*"), None, None), "not a pattern"),
        (declared(None, Some("{"), None), "does not compile"),
    ] {
        let mut v = before.clone();
        let e = v.declare(&d).unwrap_err();
        assert!(e.contains(needle), "{e:?} lacks {needle:?}");
        assert_eq!(v, before, "a refused declaration changed the verdict");
    }

    // An irreversible call cannot be declared undoable.
    let mut v = verdict("email");
    let e = v
        .declare(&declared(Some("unsend"), None, None))
        .unwrap_err();
    assert!(e.contains("irreversible"), "{e}");
    // A mapping needs a tool.
    let mut v = verdict("book");
    let e = v.declare(&declared(None, Some("{}"), None)).unwrap_err();
    assert!(e.contains("without a compensating tool"), "{e}");
}

/// An agent's `seed` can only make a call more guarded, and only where no rule spoke. Hostile
/// first: a read / undoable seed changes nothing anywhere, so an agent cannot take its call out
/// of the G1 hold or promise an undo by sending one.
#[test]
fn a_seed_fills_only_what_no_rule_set_and_only_upwards() {
    use EffectClass::{Read, Write};
    use Reversibility::{Compensable, Irreversible, Reversible, Undeclared};
    let p = Policy::parse(
        "[defaults]\nclass = \"read\"\n\
         [[rules]]\ntool = \"ruled\"\naction = \"allow\"\nclass = \"read\"\nreversibility = \"reversible\"\n\
         [[rules]]\ntool = \"undo\"\naction = \"allow\"\ncompensate = \"redo\"\n\
         [[rules]]\ntool = \"open\"\naction = \"allow\"\n",
    )
    .unwrap();
    let seeded = |name: &str, c: Option<EffectClass>, r: Option<Reversibility>| {
        let mut v = eval(&p, name, json!({})).unwrap();
        let before = v.clone();
        v.seed(c, r);
        (before, v)
    };
    for name in ["unmatched", "ruled", "undo", "open"] {
        for c in [None, Some(Read)] {
            for r in [None, Some(Reversible), Some(Compensable), Some(Undeclared)] {
                let (before, after) = seeded(name, c, r);
                assert_eq!(after, before, "{name} seeded {c:?} {r:?}");
            }
        }
    }
    // An unmatched tool is already the worst case (write, undeclared)...
    let (_, v) = seeded("unmatched", Some(Write), Some(Irreversible));
    assert_eq!((v.class, v.reversibility), (Write, Irreversible));
    // ...a rule's own class and reversibility win...
    let (_, v) = seeded("ruled", Some(Write), Some(Irreversible));
    assert_eq!((v.class, v.reversibility), (Read, Reversible));
    // ...and so does a compensation the rule names.
    let (_, v) = seeded("undo", Some(Write), Some(Irreversible));
    assert_eq!((v.class, v.reversibility), (Write, Compensable));
    // What the rule left to the defaults is filled upwards.
    let (before, v) = seeded("open", Some(Write), Some(Irreversible));
    assert_eq!((before.class, before.reversibility), (Read, Undeclared));
    assert_eq!((v.class, v.reversibility), (Write, Irreversible));
}
