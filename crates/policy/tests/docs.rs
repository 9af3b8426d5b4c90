//! Keeps docs/POLICY.md honest: every `toml` block in it is a valid policy, and the first one
//! decides the calls the text says it does.

use estop_kernel::ids::ToolName;
use estop_kernel::vocab::{EffectClass, PolicyAction};
use estop_policy::Policy;
use serde_json::json;

const DOC: &str = include_str!("../../../docs/POLICY.md");

fn toml_blocks() -> Vec<&'static str> {
    DOC.split("```toml\n")
        .skip(1)
        .filter_map(|rest| rest.split("\n```").next())
        .collect()
}

#[test]
fn every_toml_block_parses() {
    let blocks = toml_blocks();
    assert!(blocks.len() >= 2, "docs/POLICY.md lost its examples");
    for block in blocks {
        if let Err(e) = Policy::parse(block) {
            panic!("docs/POLICY.md example does not parse: {e}\n{block}");
        }
    }
}

#[test]
fn the_complete_example_decides_as_documented() {
    let p = Policy::parse(toml_blocks()[0]).unwrap();
    let eval = |tool: &str, args| {
        p.evaluate(&ToolName::new(tool).unwrap(), Some(&args), "agent")
            .unwrap()
    };

    let v = eval("search_web", json!({"q": "x"}));
    assert_eq!(
        (v.action, v.class),
        (PolicyAction::Allow, EffectClass::Read)
    );
    let v = eval("refund", json!({"amount": 150}));
    assert_eq!(
        (v.action, v.quorum, v.expiry_ms),
        (PolicyAction::Approve, 2, 600_000)
    );
    assert_eq!(v.groups, ["finance", "ops"]);
    assert_eq!(
        eval("refund", json!({"amount": 20})).action,
        PolicyAction::Allow
    );
    assert_eq!(eval("drop_table", json!({})).action, PolicyAction::Deny);
    let v = eval("send_email", json!({}));
    assert_eq!(
        (v.action, v.quorum, &*v.rule),
        (PolicyAction::Approve, 1, "unknown_tool")
    );
}

#[test]
fn the_condition_examples_evaluate() {
    let p = Policy::parse(toml_blocks()[1]).unwrap();
    let rule = |tool: &str, args, principal| {
        let v = p
            .evaluate(&ToolName::new(tool).unwrap(), Some(&args), principal)
            .unwrap();
        format!("{} by {}", v.action, v.rule)
    };
    let silver = json!({"amount": 150.5, "customer": {"tier": "silver"}});
    assert_eq!(rule("refund", silver, "agent"), "approve by rule 1");
    let gold = json!({"amount": 150.5, "customer": {"tier": "gold"}});
    assert_eq!(rule("refund", gold, "agent"), "approve by unknown_tool");
    let outside = json!({"to": "x@elsewhere.net", "attachments": []});
    assert_eq!(rule("send_email", outside, "agent"), "approve by rule 2");
    let inside = json!({"to": "a@example.com", "attachments": []});
    assert_eq!(
        rule("send_email", inside, "agent"),
        "approve by unknown_tool"
    );
    assert_eq!(
        rule("shell", json!({"argv": ["rm", "-rf", "/"]}), "agent"),
        "deny by rule 3"
    );
    assert_eq!(rule("deploy", json!({}), "agent"), "approve by rule 4");
    assert_eq!(
        rule("deploy", json!({}), "release-bot"),
        "approve by unknown_tool"
    );
    assert_eq!(
        rule("anything", json!({"dry_run": true}), "agent"),
        "allow by rule 5"
    );
}
