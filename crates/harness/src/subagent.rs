//! Sub-agents a trajectory starts itself (seed 004): the `[subagents]` tool (`delegate` by
//! default) starts a child trajectory `PARENT/CALL_ID` with the task the model gave, whose run
//! is a child of the parent's (the gate cascades a cancel; an interrupt does not cascade), with
//! a budget carved out of what the parent has left (`crate::budget::Budget::carve`: the
//! parent's spend includes the child's), within a depth and a count, never at the restrict
//! stage. The parent waits for the child's answer as the call's result, holding a record and
//! nothing else. The runner does the work (`crate::runner`); the rules and shapes are here.

use crate::chat::{Message, Role};
use crate::machine::State;
use crate::record::Record;
use crate::runner::Tool;
use serde::Deserialize;
use serde_json::json;

/// The `[subagents]` section of the config.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Subagents {
    /// The tool's name, as the model calls it.
    #[serde(default = "default_tool")]
    pub tool: String,
    #[serde(default = "default_description")]
    pub description: String,
    /// How deep a tree of sub-agents may grow: a trajectory started from outside is at depth
    /// 0, its sub-agents at 1…
    #[serde(default = "default_depth")]
    pub depth_max: u32,
    /// Sub-agents one trajectory may start, in all.
    #[serde(default = "default_children")]
    pub children_max: u32,
    /// Each sub-agent's budget: this share (per mille) of what its parent has left, in every
    /// dimension with a ceiling.
    #[serde(default = "default_share")]
    pub share_permille: u64,
}

fn default_tool() -> String {
    "delegate".into()
}
fn default_description() -> String {
    "Start a sub-agent on a self-contained task; its final answer is the result.".into()
}
fn default_depth() -> u32 {
    2
}
fn default_children() -> u32 {
    4
}
fn default_share() -> u64 {
    500
}

impl Default for Subagents {
    fn default() -> Self {
        Subagents {
            tool: default_tool(),
            description: default_description(),
            depth_max: default_depth(),
            children_max: default_children(),
            share_permille: default_share(),
        }
    }
}

/// Why a sub-agent was not started: the reason the model reads in the refusal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// The arguments have no non-empty `task`.
    BadArguments,
    /// The child would be deeper than `depth_max`.
    Depth { max: u32 },
    /// The parent started `children_max` already.
    Count { max: u32 },
    /// The budget restricts the parent (90%): no new sub-agents.
    Restricted,
    /// Nothing left to carve in a dimension.
    Budget { dimension: &'static str },
    /// The child's id is not a run id the gate takes.
    BadId(String),
}

impl Refused {
    pub fn reason(&self) -> &'static str {
        match self {
            Refused::BadArguments => "INVALID_ARGUMENTS",
            Refused::Depth { .. } => "SUBAGENT_DEPTH",
            Refused::Count { .. } => "SUBAGENT_LIMIT",
            Refused::Restricted => "NOT_GRANTED",
            Refused::Budget { .. } => "BUDGET_EXCEEDED",
            Refused::BadId(_) => "INVALID_ARGUMENTS",
        }
    }

    pub fn message(&self) -> String {
        match self {
            Refused::BadArguments => "give the sub-agent's task as {\"task\": \"…\"}".into(),
            Refused::Depth { max } => {
                format!("sub-agents may nest {max} deep; do this task yourself")
            }
            Refused::Count { max } => {
                format!("this trajectory started its {max} sub-agents already")
            }
            Refused::Restricted => "the budget is nearly spent: no new sub-agents".into(),
            Refused::Budget { dimension } => {
                format!("no {dimension} budget is left to give a sub-agent")
            }
            Refused::BadId(why) => format!("the sub-agent's id cannot be a run id: {why}"),
        }
    }
}

impl Subagents {
    pub fn check(&self) -> Result<(), String> {
        if self.depth_max == 0 || self.children_max == 0 {
            return Err("subagents: depth_max and children_max must be above 0".into());
        }
        if !(1..=1000).contains(&self.share_permille) {
            return Err("subagents: share_permille must be 1 to 1000".into());
        }
        if self.tool.is_empty() {
            return Err("subagents: tool must be named".into());
        }
        Ok(())
    }

    /// The tool the model is offered. Never read-only: the restrict stage takes it away.
    pub fn tool(&self) -> Tool {
        Tool {
            name: self.tool.clone(),
            description: self.description.clone(),
            parameters: json!({"type": "object", "properties": {"task": {"type": "string",
                "description": "the sub-agent's task, self-contained"}}, "required": ["task"]}),
            ..Tool::default()
        }
    }

    /// Whether `parent` may start one more sub-agent, and with which task: the checks that
    /// need no budget (that one is [`crate::budget::Budget::carve`]'s).
    pub fn admit(&self, parent: &Record, children: u32, args: &str) -> Result<String, Refused> {
        let task = serde_json::from_str::<serde_json::Value>(args)
            .ok()
            .and_then(|v| v["task"].as_str().map(str::to_string))
            .filter(|t| !t.trim().is_empty())
            .ok_or(Refused::BadArguments)?;
        if parent.grants.restricted {
            return Err(Refused::Restricted);
        }
        if parent.identity.depth >= self.depth_max {
            return Err(Refused::Depth {
                max: self.depth_max,
            });
        }
        if children >= self.children_max {
            return Err(Refused::Count {
                max: self.children_max,
            });
        }
        Ok(task)
    }
}

/// What the parent reads as the call's result once the sub-agent `child` ended: its answer
/// (outcome `ok`) when it COMPLETED; otherwise how it ended (`error`).
pub fn outcome(child: &Record, ctx: &[Message]) -> (&'static str, String) {
    let answer = ctx
        .iter()
        .rev()
        .find(|m| m.role == Role::Assistant && m.content.is_some())
        .and_then(|m| m.content.clone());
    match (child.state, answer) {
        (State::Completed, Some(a)) => ("ok", a),
        (state, _) => {
            let v = json!({"status": "SUBAGENT_ENDED", "state": state, "exit": child.exit,
                "message": format!("the sub-agent {} ended {state} without an answer", child.identity.id)});
            ("error", v.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::{Budget, Limits, Prices};
    use crate::record::{CallLimits, Grants, Identity};

    fn parent(depth: u32, restricted: bool) -> Record {
        let identity = Identity {
            id: "p".into(),
            tenant: "t".into(),
            task: "x".into(),
            depth,
            ..Identity::default()
        };
        let limits = CallLimits {
            model: "m".into(),
            max_output_tokens: 1,
            call_deadline_ms: 1,
            tool_deadline_ms: 1,
            retry: Default::default(),
        };
        let budget = Budget::new(Limits::default(), Prices::default(), 0);
        let grants = Grants {
            tools: Vec::new(),
            restricted,
        };
        Record::new(identity, limits, budget, grants, "log".into())
    }

    /// Every refusal fires where its bound is, and names itself to the model.
    #[test]
    fn each_bound_refuses_with_its_reason() {
        let s = Subagents {
            depth_max: 2,
            children_max: 3,
            ..Subagents::default()
        };
        let task = "{\"task\": \"count\"}";
        assert_eq!(s.admit(&parent(1, false), 2, task), Ok("count".to_string()));
        let refused = |r: Record, children: u32, args: &str| {
            s.admit(&r, children, args).unwrap_err().reason()
        };
        assert_eq!(refused(parent(2, false), 0, task), "SUBAGENT_DEPTH");
        assert_eq!(refused(parent(0, false), 3, task), "SUBAGENT_LIMIT");
        assert_eq!(refused(parent(0, true), 0, task), "NOT_GRANTED");
        for bad in ["{}", "{\"task\": \" \"}", "not json", "{\"task\": 7}"] {
            assert_eq!(
                refused(parent(0, false), 0, bad),
                "INVALID_ARGUMENTS",
                "{bad}"
            );
        }
        assert!(!s.tool().read_only, "the restrict stage takes it away");
        assert!(
            Subagents {
                share_permille: 0,
                ..Subagents::default()
            }
            .check()
            .is_err()
        );
        assert!(
            Subagents {
                depth_max: 0,
                ..Subagents::default()
            }
            .check()
            .is_err()
        );
    }
}
