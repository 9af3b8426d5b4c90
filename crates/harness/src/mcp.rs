//! MCP tools: the upstream MCP servers a harness config names (`[[server]]`, the shape of
//! `estop mcp`'s config), reached through `estop mcp`'s own upstream code
//! (`estop_mcp::upstream`: a child's stdio or streamable HTTP, restarted with backoff). Their
//! tools are offered to the model as `server__tool`; a call is admitted at the gate like any
//! other tool's, then sent upstream. Dropping a call in flight (the runner aborts it on a
//! cancel, a kill or its deadline) sends the upstream `notifications/cancelled` (rmcp's
//! cancel-on-drop); an upstream that fails mid-call leaves the call's outcome `unknown`.
//! A `sandbox = true` server runs inside `estop run`'s sandbox exactly as under `estop mcp`
//! (the same `Launch`), as a child run of the trajectory's run. A server's
//! `notifications/tools/list_changed` makes the harness list its tools again before the next
//! model call: the model is offered the tools as listed now (within the trajectory's grants).
//! Their words are pinned with `estop mcp`'s pins (`estop_mcp::pins`): a call of a tool whose
//! words changed is admitted held for an operator, and approving it pins the new words.

use crate::runner::Tool;
use estop_mcp::config::{SEPARATOR, Server};
use estop_mcp::pins::{Pin, Pins, fingerprint};
use estop_mcp::upstream::{Change, Launch, Listener, Upstream};
use rmcp::model::{
    CallToolRequest, CallToolRequestParams, CancelledNotification, CancelledNotificationParam,
    ClientRequest, ServerResult,
};
use rmcp::service::{PeerRequestOptions, ServiceError};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

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
    /// Its words (description, annotations, schemas) differ from its pin
    /// (`estop_mcp::pins`): the new fingerprint, pinned once an operator approved a call of it
    /// (the harness admits such a call held for approval, as `estop mcp` does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changed: Option<String>,
}

/// How long one re-listing of a server's tools may take; past it the previous list stays.
const RELIST_MS_MAX: u64 = 10_000;

/// Most change notices taken off the queue before one re-listing (several notices of the
/// same server are one listing).
const CHANGES_PASS_MAX: usize = 4096;

/// Where the harness's `sandbox = true` servers run: `estop run` on the trajectory's daemon,
/// each as the child run `TRAJECTORY/SERVER-STAMP` of the trajectory's run (so a cancel or kill
/// of the trajectory fences it), `STAMP` this process's start.
#[derive(Debug, Clone)]
pub struct SandboxedServers<'a> {
    pub launch: &'a crate::runner::SandboxLaunch,
    /// The trajectory's run.
    pub run: &'a str,
}

/// `servers` with, for each sandboxed one, its `sandbox_policy` credential store's source
/// variables (from this process's environment) added to its `env`: `estop run` needs them to
/// load the store and keeps them from the server it runs.
fn with_store_vars(servers: &[Server]) -> anyhow::Result<Vec<Server>> {
    let mut out = servers.to_vec();
    for s in out.iter_mut().filter(|s| s.sandbox) {
        let Some(p) = &s.sandbox_policy else { continue };
        let vars = crate::env::store_vars(p)
            .map_err(|e| anyhow::anyhow!("MCP server {:?}: sandbox_policy: {e:#}", s.name))?;
        for v in vars {
            if let Ok(value) = std::env::var(&v) {
                s.env.insert(v, value);
            }
        }
    }
    Ok(out)
}

/// The running upstreams, by server name, and the tools they list now; cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Upstreams {
    ups: Arc<BTreeMap<String, Arc<Upstream>>>,
    /// Each server's tools as last listed, by its index in the config.
    listed: Arc<Mutex<BTreeMap<usize, Vec<Tool>>>>,
    /// The servers' `notifications/tools/list_changed` (and other notices, ignored), taken
    /// before each model call ([`Upstreams::offered`]); `None` without servers.
    changes: Option<Arc<tokio::sync::Mutex<Changes>>>,
    /// The tools' pins (`estop_mcp::pins`, the file the harness was started with).
    pins: Option<Arc<Mutex<Pins>>>,
}

#[derive(Debug)]
struct Changes {
    rx: tokio::sync::mpsc::UnboundedReceiver<(usize, Change)>,
    /// The configs of the servers, by index, for the names and trust of a new listing.
    servers: Vec<Server>,
}

impl Upstreams {
    /// Starts (or connects to) every server, completes MCP's initialization and lists its tools:
    /// the tools are `server__tool`, read-only where a `trusted` server's annotation says so (an
    /// untrusted server's hints are not believed). A server that cannot be started or listed is
    /// an error naming it. A `sandbox = true` server is started by `estop run` as `estop mcp`
    /// starts one (`estop_mcp::upstream::Launch`), the child run of `sandboxed.run`; without
    /// `sandboxed`, such a server is an error. When a server says its tools changed, they are
    /// listed again before the next model call ([`Upstreams::offered`]).
    /// Each tool's words are checked against `pins` (pinned at first sight): a tool whose words
    /// changed is marked (`McpTool::changed`), and its calls are held for an operator.
    pub async fn start(
        servers: &[Server],
        sandboxed: Option<SandboxedServers<'_>>,
        pins: Option<Pins>,
    ) -> anyhow::Result<(Upstreams, Vec<Tool>)> {
        let pins = pins.map(|p| Arc::new(Mutex::new(p)));
        let launch = Arc::new(match &sandboxed {
            Some(s) => Launch {
                estop: s.launch.estop.clone(),
                data: s.launch.data.clone(),
                socket: Some(s.launch.socket.clone()),
                token: Some(s.launch.token.clone()),
                run: Some(s.run.to_string()),
                base: "agent".into(),
                tag: format!("-{:x}", crate::runner::now_ms()),
                env: Some(crate::env::for_tool(&Default::default())),
            },
            None => {
                if let Some(s) = servers.iter().find(|s| s.sandbox) {
                    anyhow::bail!(
                        "MCP server {:?}: sandbox = true needs the daemon's data directory",
                        s.name
                    );
                }
                Launch {
                    estop: std::path::PathBuf::new(),
                    data: std::path::PathBuf::from("."),
                    socket: None,
                    token: None,
                    run: None,
                    base: "agent".into(),
                    tag: String::new(),
                    env: Some(crate::env::for_tool(&Default::default())),
                }
            }
        });
        // A server starts from the allow-list and its own `env`; a sandboxed one's `estop run`
        // also gets the variables its store reads (it keeps them from the server).
        let servers = &with_store_vars(servers)?;
        let (changed, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut ups = BTreeMap::new();
        let mut listed = BTreeMap::new();
        for (index, server) in servers.iter().enumerate() {
            let listener = Listener::new(index, changed.clone());
            let up = Upstream::start(server, launch.clone(), listener).await?;
            let peer = up.peer().await.map_err(anyhow::Error::msg)?;
            let tools = list(server, &peer, pins.as_deref()).await?;
            listed.insert(index, tools);
            ups.insert(server.name.clone(), Arc::new(up));
        }
        let tools = listed.values().flatten().cloned().collect();
        let changes = Changes {
            rx,
            servers: servers.to_vec(),
        };
        Ok((
            Upstreams {
                ups: Arc::new(ups),
                listed: Arc::new(Mutex::new(listed)),
                changes: Some(Arc::new(tokio::sync::Mutex::new(changes))),
                pins,
            },
            tools,
        ))
    }

    /// The MCP tools listed now, every server's in config order; a server that said its tools
    /// changed is listed again first (at most `RELIST_MS_MAX`; a listing that fails, or is over
    /// `TOOLS_PER_SERVER_MAX`, leaves the previous one, said on stderr).
    pub async fn offered(&self) -> Vec<Tool> {
        if let Some(changes) = &self.changes {
            let mut changes = changes.lock().await;
            let mut due = std::collections::BTreeSet::new();
            for _ in 0..CHANGES_PASS_MAX {
                match changes.rx.try_recv() {
                    Ok((index, Change::Tools)) => {
                        due.insert(index);
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
            for index in due {
                let server = &changes.servers[index];
                let Some(up) = self.ups.get(&server.name) else {
                    continue;
                };
                let listing = async {
                    let peer = up.peer().await.map_err(anyhow::Error::msg)?;
                    list(server, &peer, self.pins.as_deref()).await
                };
                let limit = std::time::Duration::from_millis(RELIST_MS_MAX);
                match tokio::time::timeout(limit, listing).await {
                    Ok(Ok(tools)) => {
                        self.listed
                            .lock()
                            .expect("not poisoned")
                            .insert(index, tools);
                    }
                    Ok(Err(e)) => eprintln!(
                        "estop agent: MCP server {:?} said its tools changed; listing them \
                         again failed, the previous list stays: {e:#}",
                        server.name
                    ),
                    Err(_) => eprintln!(
                        "estop agent: MCP server {:?} said its tools changed and did not list \
                         them within {RELIST_MS_MAX} ms; the previous list stays",
                        server.name
                    ),
                }
            }
        }
        self.current()
    }

    /// The MCP tools as last listed (without listing again).
    pub fn current(&self) -> Vec<Tool> {
        let listed = self.listed.lock().expect("not poisoned");
        listed.values().flatten().cloned().collect()
    }

    /// Why a call of `name` is held for an operator whatever the policy says: its words
    /// changed since they were pinned (`None`: not an MCP tool listed now, or unchanged).
    pub fn hold_for(&self, name: &str) -> Option<&'static str> {
        let listed = self.listed.lock().expect("not poisoned");
        listed
            .values()
            .flatten()
            .find(|t| t.name == name)
            .and_then(|t| t.mcp.as_ref()?.changed.as_ref())
            .map(|_| "changed: approving accepts the tool's new description")
    }

    /// A call of `t` was admitted (approved, where its words had changed): its words are
    /// pinned now, as `estop mcp` pins them, and its later calls are not held for them.
    fn accept_pin(&self, t: &McpTool) -> Result<(), String> {
        let (Some(now), Some(pins)) = (&t.changed, &self.pins) else {
            return Ok(());
        };
        let name = format!("{}{SEPARATOR}{}", t.server, t.tool);
        pins.lock()
            .expect("not poisoned")
            .accept(&name, now)
            .map_err(|e| format!("{e:#}"))?;
        let mut listed = self.listed.lock().expect("not poisoned");
        for tool in listed.values_mut().flatten() {
            if let Some(m) = tool
                .mcp
                .as_mut()
                .filter(|m| m.changed.as_ref() == Some(now))
            {
                m.changed = None;
            }
        }
        Ok(())
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
        let Some(up) = self.ups.get(&t.server) else {
            return Some(("error", format!("no MCP server {:?} is running", t.server)));
        };
        if let Err(e) = self.accept_pin(t) {
            let why = format!("the tool's new words could not be pinned ({e}); nothing was sent");
            return Some(("error", why));
        }
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

/// `server`'s tools as `peer` lists them now, as the harness offers them, each checked
/// against its pin (pinned at first sight).
async fn list(
    server: &Server,
    peer: &rmcp::Peer<rmcp::RoleClient>,
    pins: Option<&Mutex<Pins>>,
) -> anyhow::Result<Vec<Tool>> {
    let listed = peer
        .list_all_tools()
        .await
        .map_err(|e| anyhow::anyhow!("MCP server {:?} did not list its tools: {e}", server.name))?;
    if listed.len() > TOOLS_PER_SERVER_MAX {
        anyhow::bail!(
            "MCP server {:?} lists {} tools, over the {TOOLS_PER_SERVER_MAX} the harness offers",
            server.name,
            listed.len()
        );
    }
    let mut tools = Vec::new();
    for t in listed {
        let Some(name) = offered_name(&server.name, &t.name) else {
            eprintln!(
                "estop agent: tool {:?} of MCP server {:?} is not offered: a model's function \
                 name is 1-64 of [A-Za-z0-9_-]",
                t.name, server.name
            );
            continue;
        };
        let read_only = server.trusted
            && t.annotations
                .as_ref()
                .and_then(|a| a.read_only_hint)
                .unwrap_or(false);
        let changed = match pins {
            Some(p) => match p
                .lock()
                .expect("not poisoned")
                .check(&name, &fingerprint(&t))?
            {
                Pin::Same => None,
                Pin::Changed { now } => Some(now),
            },
            None => None,
        };
        tools.push(Tool {
            name,
            description: t.description.as_deref().unwrap_or_default().to_string(),
            parameters: Value::Object((*t.input_schema).clone()),
            mcp: Some(McpTool {
                server: server.name.clone(),
                tool: t.name.to_string(),
                changed,
            }),
            read_only,
            ..Tool::default()
        });
    }
    Ok(tools)
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
