//! The task contract (seed 004: part of the trajectory's identity) and the completion check
//! the harness evaluates from it when the model ends its turn (MODEL_ENDED). Every check is one
//! the harness can make itself without trusting the model: the answer's shape, a pattern it
//! must match, tool calls that settled `ok` at the gate, files in the workspace lease. The
//! contract is checked whole when it is loaded (`[contract]` or `estop agent run --contract`);
//! a bad one is refused there, naming the field.

use serde::{Deserialize, Serialize};
use std::path::{Component, Path};

/// Entries of each list a contract may name.
pub const CONTRACT_ITEMS_MAX: usize = 32;
/// Bytes of one key, tool name or path.
pub const CONTRACT_ITEM_BYTES_MAX: usize = 256;
/// Bytes of `answer_matches`.
pub const CONTRACT_PATTERN_BYTES_MAX: usize = 1024;
/// The compiled pattern's size bound (the `regex` crate's `size_limit`).
pub const CONTRACT_PATTERN_COMPILED_BYTES_MAX: usize = 1 << 20;
/// Further turns a contract may give after a failed check.
pub const CONTRACT_ATTEMPTS_MAX: u32 = 10;
/// Characters of one failure's explanation in the record and the notice.
const WHY_CHARS_MAX: usize = 200;

/// What the answer must be.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AnswerFormat {
    /// Any non-empty text.
    #[default]
    Text,
    /// A JSON object (the whole answer, surrounding whitespace aside).
    Json,
}

/// A task contract: what a trajectory's final answer (and what it did) must satisfy for it to
/// end COMPLETED. Every trajectory's answer must be non-empty; the rest is opt-in. Read from a
/// config or a file through [`Contract::from_table`], which refuses an unknown field (a typo
/// must not drop a check); read back from the journal, unknown fields are let be.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Contract {
    #[serde(default)]
    pub answer_format: AnswerFormat,
    /// Top-level keys the JSON answer must have (with `answer_format = "json"`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub required_keys: Vec<String>,
    /// A regular expression (the `regex` crate's syntax) the answer must match somewhere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer_matches: Option<String>,
    /// Tools of which at least one call must have settled `ok` at the gate in this trajectory.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub must_call: Vec<String>,
    /// Paths, relative to the workspace lease, that must be regular files when the model ends.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workspace_files: Vec<String>,
    /// Further turns after a failed check, each with a notice naming what failed.
    #[serde(default = "one")]
    pub attempts: u32,
}

fn one() -> u32 {
    1
}

impl Default for Contract {
    fn default() -> Self {
        Contract {
            answer_format: AnswerFormat::Text,
            required_keys: Vec::new(),
            answer_matches: None,
            must_call: Vec::new(),
            workspace_files: Vec::new(),
            attempts: one(),
        }
    }
}

/// One check that failed: its name (`answer_nonempty`, `answer_format`, `required_keys`,
/// `answer_matches`, `must_call`, `workspace_files`) and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckFailure {
    pub check: String,
    pub why: String,
}

/// The completion check's last result, kept in the record.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckResult {
    pub passed: bool,
    /// The checks made, in order (each one's name).
    pub checked: Vec<String>,
    pub failed: Vec<CheckFailure>,
    /// Further turns given after failed checks so far.
    pub notices: u32,
}

/// What the harness saw of the world when the model ended (the record itself does no IO):
/// which of the contract's `workspace_files` are regular files inside the workspace lease.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct World {
    pub files_present: Vec<String>,
}

/// The fields a contract may have.
pub const CONTRACT_FIELDS: &[&str] = &[
    "answer_format",
    "required_keys",
    "answer_matches",
    "must_call",
    "workspace_files",
    "attempts",
];

/// `[contract]` of a config: [`Contract::from_table`], so an unknown field is refused.
pub fn strict<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Contract>, D::Error> {
    let t = toml::Table::deserialize(d)?;
    Contract::from_table(t)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

impl Contract {
    /// Reads a contract file: TOML, the fields of `[contract]` at top level.
    pub fn load(path: &Path) -> Result<Contract, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the contract {}: {e}", path.display()))?;
        let t: toml::Table = toml::from_str(&text)
            .map_err(|e| format!("the contract {}: {}", path.display(), e.message()))?;
        let c =
            Contract::from_table(t).map_err(|e| format!("the contract {}: {e}", path.display()))?;
        c.check()
            .map_err(|e| format!("the contract {}: {e}", path.display()))?;
        Ok(c)
    }

    /// A contract from TOML as written by a person: an unknown field is an error naming it.
    pub fn from_table(t: toml::Table) -> Result<Contract, String> {
        if let Some(k) = t.keys().find(|k| !CONTRACT_FIELDS.contains(&k.as_str())) {
            return Err(format!(
                "unknown field {k:?} (a contract has {CONTRACT_FIELDS:?})"
            ));
        }
        t.try_into::<Contract>()
            .map_err(|e| e.message().to_string())
    }

    /// Whole or refused: every bound, a pattern that compiles, keys only for JSON, paths that
    /// stay inside the workspace.
    pub fn check(&self) -> Result<(), String> {
        for (field, list) in [
            ("required_keys", &self.required_keys),
            ("must_call", &self.must_call),
            ("workspace_files", &self.workspace_files),
        ] {
            if list.len() > CONTRACT_ITEMS_MAX {
                return Err(format!(
                    "{field}: at most {CONTRACT_ITEMS_MAX} entries ({} given)",
                    list.len()
                ));
            }
            if let Some(x) = list
                .iter()
                .find(|x| x.is_empty() || x.len() > CONTRACT_ITEM_BYTES_MAX)
            {
                return Err(format!(
                    "{field}: {x:?} must be 1 to {CONTRACT_ITEM_BYTES_MAX} bytes"
                ));
            }
        }
        if !self.required_keys.is_empty() && self.answer_format != AnswerFormat::Json {
            return Err("required_keys needs answer_format = \"json\"".into());
        }
        if let Some(p) = &self.answer_matches {
            if p.len() > CONTRACT_PATTERN_BYTES_MAX {
                return Err(format!(
                    "answer_matches: at most {CONTRACT_PATTERN_BYTES_MAX} bytes"
                ));
            }
            pattern(p).map_err(|e| format!("answer_matches: {e}"))?;
        }
        for f in &self.workspace_files {
            let p = Path::new(f);
            if !p.components().all(|c| matches!(c, Component::Normal(_))) {
                return Err(format!(
                    "workspace_files: {f:?} must be a relative path inside the workspace \
                     (no `..`, `.`, or leading `/`)"
                ));
            }
        }
        if self.attempts > CONTRACT_ATTEMPTS_MAX {
            return Err(format!("attempts: at most {CONTRACT_ATTEMPTS_MAX}"));
        }
        Ok(())
    }

    /// The completion check: every check in order, the failed ones with why. `called_ok` are
    /// the tools with a call settled `ok` in this trajectory.
    pub fn evaluate(
        &self,
        answer: &str,
        called_ok: &[String],
        world: &World,
    ) -> (Vec<String>, Vec<CheckFailure>) {
        let mut checked = Vec::new();
        let mut failed = Vec::new();
        let mut fail = |check: &str, why: String| {
            failed.push(CheckFailure {
                check: check.into(),
                why: bounded(why),
            })
        };
        let trimmed = answer.trim();
        checked.push("answer_nonempty".to_string());
        if trimmed.is_empty() {
            fail("answer_nonempty", "the answer is empty".into());
        }
        if self.answer_format == AnswerFormat::Json {
            checked.push("answer_format".into());
            match serde_json::from_str::<serde_json::Value>(trimmed) {
                Ok(serde_json::Value::Object(m)) => {
                    if !self.required_keys.is_empty() {
                        checked.push("required_keys".into());
                        let missing: Vec<&String> = self
                            .required_keys
                            .iter()
                            .filter(|k| !m.contains_key(k.as_str()))
                            .collect();
                        if !missing.is_empty() {
                            fail("required_keys", format!("the answer lacks {missing:?}"));
                        }
                    }
                }
                Ok(_) => fail(
                    "answer_format",
                    "the answer must be a JSON object, and is other JSON".into(),
                ),
                Err(e) => fail(
                    "answer_format",
                    format!("the answer must be a JSON object: {e}"),
                ),
            }
        }
        if let Some(p) = &self.answer_matches {
            checked.push("answer_matches".into());
            // Checked when the contract was loaded; a record from elsewhere fails closed.
            match pattern(p) {
                Ok(re) if re.is_match(answer) => {}
                Ok(_) => fail("answer_matches", format!("the answer does not match {p:?}")),
                Err(e) => fail("answer_matches", e),
            }
        }
        if !self.must_call.is_empty() {
            checked.push("must_call".into());
            let missing: Vec<&String> = self
                .must_call
                .iter()
                .filter(|t| !called_ok.contains(t))
                .collect();
            if !missing.is_empty() {
                fail("must_call", format!("no call settled ok for {missing:?}"));
            }
        }
        if !self.workspace_files.is_empty() {
            checked.push("workspace_files".into());
            let missing: Vec<&String> = self
                .workspace_files
                .iter()
                .filter(|f| !world.files_present.contains(f))
                .collect();
            if !missing.is_empty() {
                fail(
                    "workspace_files",
                    format!("not regular files in the workspace: {missing:?}"),
                );
            }
        }
        (checked, failed)
    }
}

fn pattern(p: &str) -> Result<regex::Regex, String> {
    regex::RegexBuilder::new(p)
        .size_limit(CONTRACT_PATTERN_COMPILED_BYTES_MAX)
        .build()
        .map_err(|e| e.to_string())
}

fn bounded(s: String) -> String {
    if s.chars().count() <= WHY_CHARS_MAX {
        return s;
    }
    let mut t: String = s.chars().take(WHY_CHARS_MAX).collect();
    t.push('…');
    t
}

/// Which of `files` are regular files inside `workspace`: each path's every component is
/// looked at without following links (a link anywhere on the way, or a path that is not the
/// contract's plain relative shape, is not present).
pub fn files_present(workspace: Option<&Path>, files: &[String]) -> Vec<String> {
    let Some(root) = workspace else {
        return Vec::new();
    };
    files
        .iter()
        .filter(|f| {
            let rel = Path::new(f.as_str());
            let comps: Vec<Component> = rel.components().collect();
            if comps.is_empty() || !comps.iter().all(|c| matches!(c, Component::Normal(_))) {
                return false;
            }
            let mut at = root.to_path_buf();
            for (i, c) in comps.iter().enumerate() {
                at.push(c);
                let Ok(m) = std::fs::symlink_metadata(&at) else {
                    return false;
                };
                let last = i + 1 == comps.len();
                if (last && !m.file_type().is_file()) || (!last && !m.file_type().is_dir()) {
                    return false;
                }
            }
            true
        })
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_contract_is_refused_naming_the_field() {
        let bad = |c: Contract, field: &str| {
            let e = c.check().unwrap_err();
            assert!(e.contains(field), "{e}");
        };
        bad(
            Contract {
                workspace_files: vec!["../etc/passwd".into()],
                ..Contract::default()
            },
            "workspace_files",
        );
        bad(
            Contract {
                workspace_files: vec!["/etc/passwd".into()],
                ..Contract::default()
            },
            "workspace_files",
        );
        bad(
            Contract {
                answer_matches: Some("(".into()),
                ..Contract::default()
            },
            "answer_matches",
        );
        // A pattern whose compiled form is over the bound.
        bad(
            Contract {
                answer_matches: Some("\\w{1000}\\w{1000}\\w{1000}".into()),
                ..Contract::default()
            },
            "answer_matches",
        );
        bad(
            Contract {
                required_keys: vec!["k".into()],
                ..Contract::default()
            },
            "required_keys",
        );
        bad(
            Contract {
                must_call: vec!["t".into(); CONTRACT_ITEMS_MAX + 1],
                ..Contract::default()
            },
            "must_call",
        );
        bad(
            Contract {
                attempts: CONTRACT_ATTEMPTS_MAX + 1,
                ..Contract::default()
            },
            "attempts",
        );
        let typo: toml::Table = toml::from_str("answer_fromat = \"json\"").unwrap();
        let e = Contract::from_table(typo).unwrap_err();
        assert!(e.contains("answer_fromat"), "{e}");
        // Read back from a journal written by a later version, a field it added is let be.
        let later = serde_json::json!({"attempts": 2, "answer_min_words": 5});
        assert_eq!(
            serde_json::from_value::<Contract>(later).unwrap().attempts,
            2
        );
    }

    #[test]
    fn each_check_fails_with_its_name() {
        let c = Contract {
            answer_format: AnswerFormat::Json,
            required_keys: vec!["total".into()],
            answer_matches: Some("\"total\":\\s*\\d+".into()),
            must_call: vec!["lookup".into()],
            workspace_files: vec!["report.md".into()],
            attempts: 1,
        };
        c.check().unwrap();
        let names = |f: &[CheckFailure]| f.iter().map(|f| f.check.clone()).collect::<Vec<_>>();
        let (checked, f) = c.evaluate("{\"sum\": 3}", &[], &World::default());
        assert_eq!(checked.len(), 6);
        assert_eq!(
            names(&f),
            [
                "required_keys",
                "answer_matches",
                "must_call",
                "workspace_files"
            ]
        );
        let (_, f) = c.evaluate("[1]", &[], &World::default());
        assert_eq!(names(&f)[0], "answer_format");
        let world = World {
            files_present: vec!["report.md".into()],
        };
        let (_, f) = c.evaluate(" {\"total\": 3} ", &["lookup".into()], &world);
        assert!(f.is_empty(), "{f:?}");
        let (_, f) = Contract::default().evaluate("  ", &[], &world);
        assert_eq!(names(&f), ["answer_nonempty"]);
    }

    #[test]
    fn only_regular_files_inside_the_workspace_are_present() {
        let dir = tempfile::tempdir().unwrap();
        let ws = dir.path().join("ws");
        std::fs::create_dir_all(ws.join("sub")).unwrap();
        std::fs::write(ws.join("report.md"), "x").unwrap();
        std::fs::write(ws.join("sub/a.txt"), "x").unwrap();
        std::fs::write(dir.path().join("outside.md"), "x").unwrap();
        std::os::unix::fs::symlink(dir.path().join("outside.md"), ws.join("link.md")).unwrap();
        std::os::unix::fs::symlink(dir.path(), ws.join("up")).unwrap();
        let files: Vec<String> = [
            "report.md",
            "sub/a.txt",
            "sub",
            "link.md",
            "up/outside.md",
            "../outside.md",
            "missing.md",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(files_present(Some(&ws), &files), ["report.md", "sub/a.txt"]);
        assert!(files_present(None, &files).is_empty());
    }
}
