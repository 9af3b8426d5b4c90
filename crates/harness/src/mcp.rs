//! MCP tools: the upstream MCP servers a harness config names (`[[server]]`, the shape of
//! `estop mcp`'s config), reached through `estop mcp`'s own upstream code
//! (`estop_mcp::upstream`: a child's stdio or streamable HTTP, restarted with backoff). Their
//! tools are offered to the model as `server__tool`; a call is admitted at the gate like any
//! other tool's, then sent upstream. Dropping a call in flight (the runner aborts it on a
//! cancel, a kill or its deadline) sends the upstream `notifications/cancelled` (rmcp's
//! cancel-on-drop); an upstream that fails mid-call leaves the call's outcome `unknown`.

use crate::runner::Tool;
use estop_mcp::config::{SEPARATOR, Server};
use estop_mcp::upstream::{Launch, Listener, Upstream};
use rmcp::model::{
    CallToolRequest, CallToolRequestParams, CancelledNotification, CancelledNotificationParam,
    ClientRequest, ServerResult,
};
use rmcp::service::{PeerRequestOptions, ServiceError};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Largest result of an MCP tool kept (what the model will read of it), as for HTTP tools.
const RESULT_BYTES_MAX: usize = 1 << 20;

/// Tools listed by one upstream at most; a server listing more is refused at start.
const TOOLS_PER_SERVER_MAX: usize = 256;

/// Which upstream tool a harness tool is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct McpTool {
    /// The `[[server]]`'s name.
    pub server: String,
    /// The tool's own name on that server.
    pub tool: String,
}

/// The running upstreams, by server name; cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Upstreams(Arc<BTreeMap<String, Arc<Upstream>>>);

impl Upstreams {
    /// Starts (or connects to) every server, completes MCP's initialization and lists its tools
    /// once: the tools are `server__tool`, read-only where a `trusted` server's annotation says
    /// so (an untrusted server's hints are not believed). A server that cannot be started or
    /// listed is an error naming it. The list is not taken again when a server says its tools
    /// changed: the model is offered what was listed at start.
    pub async fn start(servers: &[Server]) -> anyhow::Result<(Upstreams, Vec<Tool>)> {
        // Read only for `sandbox = true` servers, which the harness's config refuses.
        let launch = Arc::new(Launch {
            estop: std::env::current_exe()?,
            data: std::path::PathBuf::from("."),
            socket: None,
            token: None,
            run: None,
            base: "agent".into(),
        });
        // Change notices go nowhere: the tools are listed once (above).
        let (changed, _) = tokio::sync::mpsc::unbounded_channel();
        let mut ups = BTreeMap::new();
        let mut tools = Vec::new();
        for (index, server) in servers.iter().enumerate() {
            let listener = Listener::new(index, changed.clone());
            let up = Upstream::start(server, launch.clone(), listener).await?;
            let peer = up.peer().await.map_err(anyhow::Error::msg)?;
            let listed = peer.list_all_tools().await.map_err(|e| {
                anyhow::anyhow!("MCP server {:?} did not list its tools: {e}", server.name)
            })?;
            if listed.len() > TOOLS_PER_SERVER_MAX {
                anyhow::bail!(
                    "MCP server {:?} lists {} tools, over the {TOOLS_PER_SERVER_MAX} the harness offers",
                    server.name,
                    listed.len()
                );
            }
            for t in listed {
                let Some(name) = offered_name(&server.name, &t.name) else {
                    eprintln!(
                        "estop agent: tool {:?} of MCP server {:?} is not offered: a model's \
                         function name is 1-64 of [A-Za-z0-9_-]",
                        t.name, server.name
                    );
                    continue;
                };
                let read_only = server.trusted
                    && t.annotations
                        .as_ref()
                        .and_then(|a| a.read_only_hint)
                        .unwrap_or(false);
                tools.push(Tool {
                    name,
                    description: t.description.as_deref().unwrap_or_default().to_string(),
                    parameters: Value::Object((*t.input_schema).clone()),
                    command: Vec::new(),
                    url: None,
                    mcp: Some(McpTool {
                        server: server.name.clone(),
                        tool: t.name.to_string(),
                    }),
                    read_only,
                    sandbox: false,
                    sandbox_policy: None,
                    egress: None,
                    credentials: None,
                });
            }
            ups.insert(server.name.clone(), Arc::new(up));
        }
        Ok((Upstreams(Arc::new(ups)), tools))
    }

    /// Sends one admitted call upstream: `(outcome, observation)` with the outcome the gate
    /// records — `ok`, `error` (the tool said so, the server refused the request, or nothing
    /// could be sent), `unknown` (the server failed mid-call: it may or may not have acted).
    /// `None` when `cut` was set first: the upstream was sent `notifications/cancelled` (and the
    /// write awaited, so a runner about to exit does not lose it); the runner settles the call.
    pub async fn call(
        &self,
        t: &McpTool,
        args: &str,
        mut cut: tokio::sync::watch::Receiver<bool>,
    ) -> Option<(&'static str, String)> {
        let Some(up) = self.0.get(&t.server) else {
            return Some(("error", format!("no MCP server {:?} is running", t.server)));
        };
        let args = if args.trim().is_empty() { "{}" } else { args };
        let arguments = match serde_json::from_str::<Value>(args) {
            Ok(Value::Object(m)) => m,
            _ => {
                let why = "the arguments are not a JSON object; nothing was sent to the tool";
                return Some(("error", why.into()));
            }
        };
        let peer = match up.peer().await {
            Ok(p) => p,
            Err(why) => return Some(("error", format!("{why}; nothing was sent to the tool"))),
        };
        let mut params = CallToolRequestParams::new(t.tool.clone());
        params.arguments = Some(arguments);
        let request = ClientRequest::CallToolRequest(CallToolRequest::new(params));
        let handle = match peer
            .send_cancellable_request(request, PeerRequestOptions::no_options())
            .await
        {
            Ok(h) => h,
            Err(e) => {
                let why = format!("the tool's server could not be sent the call ({e})");
                return Some(("error", why));
            }
        };
        let id = handle.id.clone();
        let answer = tokio::select! {
            a = handle.await_response() => a,
            () = async { let _ = cut.wait_for(|c| *c).await; } => {
                let note = CancelledNotification::new(CancelledNotificationParam::new(
                    Some(id),
                    Some("cancelled by estop: the trajectory stopped".into()),
                ));
                // An upstream already gone hears nothing: the call is unknown either way.
                let _ = peer.send_notification(note.into()).await;
                return None;
            }
        };
        Some(match answer {
            Ok(ServerResult::CallToolResult(r)) => {
                let outcome = if r.is_error == Some(true) {
                    "error"
                } else {
                    "ok"
                };
                let texts: Vec<&str> = r
                    .content
                    .iter()
                    .filter_map(|c| c.as_text().map(|t| t.text.as_str()))
                    .collect();
                let text = if texts.is_empty() {
                    serde_json::to_string(&r).unwrap_or_default()
                } else {
                    texts.join("\n")
                };
                (outcome, cut_text(text))
            }
            Ok(other) => (
                "unknown",
                format!("the tool's server answered something other than a result: {other:?}"),
            ),
            Err(ServiceError::McpError(e)) => (
                "error",
                format!("the tool's server refused the call: {}", e.message),
            ),
            Err(e) => (
                "unknown",
                format!("the tool's server failed mid-call ({e}); it may or may not have acted"),
            ),
        })
    }
}

/// The name the model is offered for `server`'s `tool`: `server__tool`, if it is a valid
/// function name for an OpenAI-compatible provider (1-64 of `[A-Za-z0-9_-]`; MCP also allows
/// `.`, which such a provider refuses, failing every call that offers it).
fn offered_name(server: &str, tool: &str) -> Option<String> {
    let name = format!("{server}{SEPARATOR}{tool}");
    let ok = name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    ok.then_some(name)
}

/// The text cut at `RESULT_BYTES_MAX` (on a character boundary), saying so.
fn cut_text(mut text: String) -> String {
    if text.len() <= RESULT_BYTES_MAX {
        return text;
    }
    let mut at = RESULT_BYTES_MAX;
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    text.truncate(at);
    text.push_str("\n[cut: the result was over 1 MiB]");
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_valid_function_names_are_offered() {
        assert_eq!(
            offered_name("files", "read").as_deref(),
            Some("files__read")
        );
        assert_eq!(offered_name("files", "read.v2"), None);
        assert_eq!(offered_name("files", &"x".repeat(58)), None);
        assert!(offered_name("files", &"x".repeat(57)).is_some());
    }

    #[test]
    fn a_long_result_is_cut_on_a_character_boundary() {
        let long = "é".repeat(RESULT_BYTES_MAX);
        let c = cut_text(long);
        assert!(c.len() <= RESULT_BYTES_MAX + 40);
        assert!(c.ends_with("over 1 MiB]"));
        assert_eq!(cut_text("short".into()), "short");
    }
}
