//! Keeps docs/PROTOCOL.md in step with the code: every error code, verb, limit and verdict the
//! crate knows is documented there.

use estop_protocol::limits::*;
use estop_protocol::{ErrorCode, Verb};

fn protocol_md() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/PROTOCOL.md");
    std::fs::read_to_string(path).expect("docs/PROTOCOL.md exists")
}

#[test]
fn every_error_code_has_a_row() {
    let doc = protocol_md();
    for code in ErrorCode::ALL {
        assert!(
            doc.contains(&format!("| `{}` |", code.as_str())),
            "{} is not in the error table",
            code.as_str()
        );
    }
}

#[test]
fn every_verb_has_a_section_naming_its_fields() {
    let doc = protocol_md();
    for verb in Verb::ALL {
        let heading = doc
            .lines()
            .find(|l| l.starts_with("#### ") && l.contains(&format!("`{}", verb.as_str())))
            .unwrap_or_else(|| panic!("no section for {}", verb.as_str()));
        for field in verb.fields() {
            assert!(
                heading.contains(field),
                "section of {} does not name `{field}`: {heading}",
                verb.as_str()
            );
        }
    }
}

#[test]
fn limits_match_the_table() {
    let doc = protocol_md();
    for n in [
        LINE_BYTES_MAX_DEFAULT,
        ID_BYTES_MAX,
        TOKEN_BYTES_MAX,
        REASON_BYTES_MAX,
        ERROR_BYTES_MAX,
        RESULT_BYTES_MAX,
        LABELS_MAX,
        LABEL_KEY_BYTES_MAX,
        LABEL_VALUE_BYTES_MAX,
        GROUPS_MAX,
        GROUP_BYTES_MAX,
        CURSOR_BYTES_MAX,
    ] {
        assert!(
            doc.contains(&n.to_string()),
            "limit {n} is not in docs/PROTOCOL.md"
        );
    }
}

#[test]
fn the_precedence_section_is_still_there_for_the_kernel() {
    assert!(protocol_md().contains("## Admission precedence"));
}
