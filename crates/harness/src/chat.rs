//! The chat vocabulary shared by the core and the model client: messages as the
//! OpenAI-compatible chat-completions API has them, a proposed tool call, and how a model call
//! ended. Pure data.

use crate::budget::Usage;
use serde::{Deserialize, Serialize};

/// One message of a trajectory's context.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Message {
    pub fn system(text: impl Into<String>) -> Message {
        Message::text(Role::System, text)
    }
    pub fn user(text: impl Into<String>) -> Message {
        Message::text(Role::User, text)
    }
    pub fn text(role: Role, text: impl Into<String>) -> Message {
        Message {
            role,
            content: Some(text.into()),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
    /// The observation of one tool call: its result, or the structured refusal or marker the
    /// harness put in its place.
    pub fn tool(call_id: &str, content: String) -> Message {
        Message {
            role: Role::Tool,
            content: Some(content),
            tool_calls: Vec::new(),
            tool_call_id: Some(call_id.to_string()),
        }
    }
}

/// A tool call the model proposed, complete (only a reply that ended normally has any).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type", default = "function")]
    pub kind: String,
    pub function: FunctionCall,
}

fn function() -> String {
    "function".to_string()
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as the model wrote them (JSON text).
    pub arguments: String,
}

impl ToolCall {
    pub fn new(id: &str, name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            id: id.to_string(),
            kind: function(),
            function: FunctionCall {
                name: name.to_string(),
                arguments: arguments.to_string(),
            },
        }
    }
}

/// The most of a tool error about invalid arguments the model is sent back, in bytes (the
/// problem's own words; the arguments are never echoed whole).
pub const ARGUMENT_PROBLEM_BYTES_MAX: usize = 512;

/// What is wrong with a proposed call's arguments, if anything: they must be a JSON object
/// (the function-calling contract; every tool here takes one). The answer is bounded by
/// [`ARGUMENT_PROBLEM_BYTES_MAX`] and names the problem: `not valid JSON` (with the parser's
/// position) or `not an object` (with the JSON type it is).
pub fn argument_problem(call: &ToolCall) -> Option<String> {
    let problem = match serde_json::from_str::<serde_json::Value>(&call.function.arguments) {
        Err(e) => format!("the arguments are not valid JSON ({e})"),
        Ok(serde_json::Value::Object(_)) => return None,
        Ok(v) => {
            let kind = match v {
                serde_json::Value::Null => "null",
                serde_json::Value::Bool(_) => "a boolean",
                serde_json::Value::Number(_) => "a number",
                serde_json::Value::String(_) => "a string",
                serde_json::Value::Array(_) => "an array",
                serde_json::Value::Object(_) => unreachable!("returned above"),
            };
            format!("the arguments are not an object (they are {kind})")
        }
    };
    Some(truncate(problem, ARGUMENT_PROBLEM_BYTES_MAX))
}

/// `s` cut to at most `max` bytes, on a character boundary.
pub(crate) fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut at = max;
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
    }
    s
}

/// The provider's `finish_reason`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// The model ended its turn (`stop`): a request to run the completion check.
    Stop,
    ToolCalls,
    /// Truncated at the output bound: never dispatched.
    Length,
    ContentFilter,
    Other(String),
}

impl Finish {
    pub fn parse(s: &str) -> Finish {
        match s {
            "stop" => Finish::Stop,
            "tool_calls" | "function_call" => Finish::ToolCalls,
            "length" => Finish::Length,
            "content_filter" => Finish::ContentFilter,
            other => Finish::Other(other.to_string()),
        }
    }
}

/// How one model call ended, as the core is told.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    /// The stream reached its terminal event.
    Finished {
        finish: Finish,
        text: String,
        tool_calls: Vec<ToolCall>,
        usage: Option<Usage>,
    },
    /// The harness cut the stream (a control request): the partial reply is discarded.
    Cut { usage: Option<Usage> },
    /// The call failed (HTTP error, 429, 5xx, a stream that ended without its terminal event,
    /// the call deadline): retried after a backoff (crate::record::Retry) while the budget and
    /// the retry bound allow. `retry_after_ms` is the provider's `Retry-After`, when it gave one.
    Failed {
        error: String,
        retryable: bool,
        usage: Option<Usage>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        retry_after_ms: Option<u64>,
    },

    /// The reply passed one of the stream's bounds (`crate::model::Bounds`): the harness cut
    /// the stream there and discarded everything it held of the reply; nothing in it is
    /// dispatched. The model is told which bound it passed and gets another turn (the budget
    /// deciding, as for every turn).
    Overflow {
        overflow: Overflow,
        usage: Option<Usage>,
    },
}

/// Which bound of the model stream a reply passed (`crate::model::Bounds`, docs/HARNESS.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "bound", rename_all = "snake_case")]
pub enum Overflow {
    /// A tool call delta's `index` at or past the calls one reply may propose.
    #[error("a tool call at index {index}, over the {max} tool calls one reply may propose")]
    ToolCalls { index: u64, max: usize },
    /// One server-sent event (the bytes up to its blank line) longer than this.
    #[error("a stream event over {max} bytes")]
    EventBytes { max: usize },
    /// One tool call's id, name and arguments together longer than this.
    #[error("tool call {index} over {max} bytes (its id, name and arguments)")]
    ToolCallBytes { index: usize, max: usize },
    /// The whole response body longer than this.
    #[error("a reply over {max} bytes")]
    ResponseBytes { max: usize },
}
