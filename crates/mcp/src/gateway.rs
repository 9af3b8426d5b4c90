//! The MCP server the agent talks to: tools of every upstream under `server__tool`, and every
//! `tools/call` admitted by the gate as an effect before the upstream is called.

use crate::config::SEPARATOR;
use crate::pins::{Pin, Pins, Seed, fingerprint};
use crate::upstream::Upstream;
use estop_egress::gate::Gate;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, GetPromptRequestParams,
    GetPromptResponse, ListPromptsResult, ListResourcesResult, ListToolsResult,
    PaginatedRequestParams, ReadResourceRequestParams, ReadResourceResponse, ServerCapabilities,
    ServerConfig, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData as McpError, ServerHandler};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// The `_meta` field a client may set to name a call's idempotency key itself.
pub const KEY_META: &str = "io.estop/key";

/// A recorded result larger than this is not kept (protocol v1 takes 64 KiB of `result`).
const RESULT_BYTES_MAX: usize = 60 * 1024;

#[derive(Clone, Debug)]
pub struct Gateway {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    upstreams: Vec<Upstream>,
    tools: Mutex<BTreeMap<String, Entry>>,
    pins: Mutex<Pins>,
    gate: Gate,
    run: String,
    parent: Option<String>,
    hold_ms: u64,
    /// True once the run is stopped (cancelled, killed, closed): in-flight calls are cut.
    fence: watch::Sender<bool>,
    /// Whether this gateway subscribed to the run's events yet (it can once the run exists).
    subscribed: std::sync::atomic::AtomicBool,
    /// Calls of trusted read-only tools get a fresh key each (a re-read is not a replay).
    reads: std::sync::atomic::AtomicU64,
    /// Which upstream each listed resource URI belongs to.
    routes: Mutex<BTreeMap<String, usize>>,
    /// Whether any upstream offers resources, prompts.
    offers: (bool, bool),
    /// Tells this process's read keys from an earlier session's in the same run.
    session: String,
}

#[derive(Debug, Clone)]
struct Entry {
    upstream: usize,
    tool: Tool,
    seed: Seed,
    pin: Pin,
}

/// Where a call stands after the gate answered.
enum Admission {
    Go { token: String },
    Answer(CallToolResult),
}

impl Gateway {
    pub fn new(
        upstreams: Vec<Upstream>,
        pins: Pins,
        gate: Gate,
        run: String,
        parent: Option<String>,
        hold_ms: u64,
        fence: watch::Sender<bool>,
    ) -> Gateway {
        Gateway {
            inner: Arc::new(Inner {
                offers: crate::passthrough::offers(&upstreams),
                routes: Mutex::new(BTreeMap::new()),
                upstreams,
                tools: Mutex::new(BTreeMap::new()),
                pins: Mutex::new(pins),
                gate,
                run,
                parent,
                hold_ms,
                fence,
                subscribed: false.into(),
                reads: 0.into(),
                session: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos())
                    .to_string(),
            }),
        }
    }

    /// Lists every upstream's tools again, checking each against its pin.
    async fn refresh(&self) -> Result<Vec<Tool>, McpError> {
        let mut listed = BTreeMap::new();
        for (i, up) in self.inner.upstreams.iter().enumerate() {
            let tools = up.client.peer().list_all_tools().await.map_err(|e| {
                McpError::internal_error(format!("upstream {:?}: {e}", up.name), None)
            })?;
            for tool in tools {
                let name = format!("{}{SEPARATOR}{}", up.name, tool.name);
                let pin = self
                    .inner
                    .pins
                    .lock()
                    .expect("not poisoned")
                    .check(&name, &fingerprint(&tool))
                    .map_err(|e| McpError::internal_error(format!("{e:#}"), None))?;
                let seed = Seed::of(&tool, up.trusted);
                listed.insert(
                    name,
                    Entry {
                        upstream: i,
                        tool,
                        seed,
                        pin,
                    },
                );
            }
        }
        let out = listed
            .iter()
            .map(|(name, e)| {
                let mut t = e.tool.clone();
                t.name = name.clone().into();
                t
            })
            .collect();
        *self.inner.tools.lock().expect("not poisoned") = listed;
        Ok(out)
    }

    async fn entry(&self, name: &str) -> Result<Entry, McpError> {
        if let Some(e) = self.inner.tools.lock().expect("not poisoned").get(name) {
            return Ok(e.clone());
        }
        self.refresh().await?;
        let tools = self.inner.tools.lock().expect("not poisoned");
        tools.get(name).cloned().ok_or_else(|| {
            McpError::invalid_params(format!("no tool {name:?} (see tools/list)"), None)
        })
    }

    /// The effect's key within the run: the client's own (`_meta["io.estop/key"]`), else the
    /// call's digest, so the same call repeated in the session is the same effect.
    fn key(
        &self,
        req: &CallToolRequestParams,
        meta: &rmcp::model::RequestMetaObject,
        digest: &str,
        e: &Entry,
        trusted: bool,
    ) -> String {
        // rmcp hands a request's `_meta` to the handler in its context; the params may keep
        // it too: either will do.
        let meta = req.meta.as_ref().unwrap_or(meta);
        let own = meta.0.get(KEY_META).and_then(Value::as_str);
        if let Some(k) = own {
            return format!("mcp:{k}");
        }
        if trusted && e.seed.read_only {
            let n = self
                .inner
                .reads
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return format!("mcp:{digest}:read-{}-{n}", self.inner.session);
        }
        format!("mcp:{digest}")
    }
}

/// A result the model reads: what happened, and what to do instead.
fn refusal(text: String) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(text)])
}

impl Gateway {
    /// Asks the gate to admit the call, waiting up to `hold_ms` while it is held.
    async fn admit(
        &self,
        name: &str,
        key: &str,
        args: &Value,
        e: &Entry,
        ct: &tokio_util::sync::CancellationToken,
    ) -> Result<Admission, McpError> {
        let i = &self.inner;
        let mut labels = e.seed.labels();
        labels["mcp.server"] = json!(i.upstreams[e.upstream].name);
        let changed = matches!(e.pin, Pin::Changed { .. });
        if changed {
            labels["mcp.pin"] = json!("changed: approving accepts the tool's new description");
        }
        let mut admit = json!({"op": "admit", "run": i.run, "key": key, "tool": name,
            "args": args, "start": true, "labels": labels, "needs_approval": changed});
        if let Some(p) = &i.parent {
            admit["parent"] = json!(p);
        }
        let mut v = self.gate(admit).await?;
        if v["ok"] == true && v["verdict"] == "held" {
            let wait = json!({"op": "wait", "run": i.run, "key": key, "timeout_ms": i.hold_ms});
            v = tokio::select! {
                v = self.gate(wait) => v?,
                () = ct.cancelled() => return Ok(Admission::Answer(refusal(
                    "the call was cancelled while it was held; nothing was run".into()))),
            };
        }
        if v["ok"] == true
            && !i
                .subscribed
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            // The run exists now: follow its stops; one that landed before is read at once.
            self.gate(json!({"op": "subscribe", "run": i.run})).await?;
            crate::check(&i.gate, &i.run, &i.fence).await;
        }
        if v["ok"] != true {
            return Ok(Admission::Answer(refusal(format!(
                "the gate did not admit this call ({}); nothing was run",
                v["error"]
            ))));
        }
        Ok(match v["verdict"].as_str().unwrap_or("") {
            "admitted" => {
                if let Pin::Changed { now } = &e.pin {
                    self.accept_pin(name, now)?;
                }
                Admission::Go {
                    token: v["token"].as_str().unwrap_or_default().to_string(),
                }
            }
            "held" => Admission::Answer(held(&i.run, key, &v)),
            "duplicate" => Admission::Answer(replay(&v)),
            _ => Admission::Answer(refused(&i.run, key, &v)),
        })
    }

    fn accept_pin(&self, name: &str, now: &str) -> Result<(), McpError> {
        self.inner
            .pins
            .lock()
            .expect("not poisoned")
            .accept(name, now)
            .map_err(|e| McpError::internal_error(format!("{e:#}"), None))?;
        if let Some(e) = self.inner.tools.lock().expect("not poisoned").get_mut(name) {
            e.pin = Pin::Same;
        }
        Ok(())
    }

    async fn gate(&self, req: Value) -> Result<Value, McpError> {
        self.inner.gate.call(req).await.map_err(|e| {
            McpError::internal_error(
                format!("estop's gate is unreachable ({e:#}); nothing was run"),
                None,
            )
        })
    }
}

fn held(run: &str, key: &str, v: &Value) -> CallToolResult {
    let why = match v["reason"].as_str() {
        Some("approval") => format!(
            "it needs an operator's approval (approval {}, expires at {} ms)",
            v["approval"], v["expires_at"]
        ),
        Some("sibling") => "another call of this run awaits an operator's approval".to_string(),
        Some("paused") => "an operator paused this run".to_string(),
        _ => format!("the gate holds it ({})", v["reason"]),
    };
    refusal(format!(
        "HELD, not run: {why}. Nothing was sent to the tool. An operator decides on estop's \
         own channel (`estop pending`, `estop approve {run} {key}`, or the console); you cannot \
         approve it. Call this tool again with the same arguments later to get the decision, \
         or carry on without it."
    ))
}

fn refused(run: &str, key: &str, v: &Value) -> CallToolResult {
    let reason = v["reason"].as_str().unwrap_or("refused");
    let advice = match reason {
        "cancelled" | "closed" => "the run is stopped: make no further tool calls",
        "rejected" => "an operator rejected this call: do not retry it in any form",
        "denied" => "the policy forbids this tool or these arguments: do not retry it",
        "expired" => "no operator approved it in time: ask the user before trying again",
        "budget" | "deadline" => "the run has used up its allowance: stop and report",
        "mismatch" => "this key was used for other arguments: use a new key",
        _ => "do not retry it",
    };
    let msg = v["message"]
        .as_str()
        .map(|m| format!(" ({m})"))
        .unwrap_or_default();
    refusal(format!(
        "REFUSED, not run: {reason}{msg} (run {run}, key {key}). Nothing was sent to the tool; \
         {advice}."
    ))
}

/// The recorded outcome of a call made before with the same identity.
fn replay(v: &Value) -> CallToolResult {
    if v["status"] == "in_progress" {
        return refusal(
            "this same call is already running (same arguments or key); it is not run twice. \
             Wait for its result."
                .into(),
        );
    }
    match serde_json::from_value::<CallToolResult>(v["result"]["mcp"].clone()) {
        Ok(result) => result,
        Err(_) => refusal(format!(
            "this call was made before (status {}, outcome {}) and is not run again; its result \
             was not recorded ({}). Use a different `_meta[\"{KEY_META}\"]` to make a new call.",
            v["status"], v["outcome"], v["error"]
        )),
    }
}

/// How an upstream call ended.
enum Ended {
    Done(Result<CallToolResult, rmcp::service::ServiceError>),
    /// The client sent `notifications/cancelled` (or went away).
    ByClient,
    /// The run was stopped on estop's side.
    ByRun,
}

impl Gateway {
    /// Calls the upstream, cut short by the client's cancel or the run's stop; dropping the
    /// upstream call sends `notifications/cancelled` to the upstream (rmcp's cancel-on-drop).
    async fn forward(
        &self,
        e: &Entry,
        params: CallToolRequestParams,
        ct: &tokio_util::sync::CancellationToken,
    ) -> Ended {
        let mut fence = self.inner.fence.subscribe();
        let peer = self.inner.upstreams[e.upstream].client.peer().clone();
        tokio::select! {
            r = peer.call_tool(params) => Ended::Done(r),
            () = ct.cancelled() => Ended::ByClient,
            _ = fence.wait_for(|stopped| *stopped) => Ended::ByRun,
        }
    }

    /// Reports what happened to the gate, and makes what the client gets.
    async fn complete(&self, key: &str, token: &str, ended: Ended) -> CallToolResult {
        let (outcome, result, error, answer) = match ended {
            Ended::Done(Ok(r)) => {
                let outcome = if r.is_error == Some(true) {
                    "error"
                } else {
                    "ok"
                };
                let recorded = serde_json::to_value(&r).unwrap_or(Value::Null);
                let result = if recorded.to_string().len() <= RESULT_BYTES_MAX {
                    json!({"mcp": recorded})
                } else {
                    json!({"mcp_result_bytes_over": RESULT_BYTES_MAX})
                };
                (outcome, result, None, r)
            }
            Ended::Done(Err(rmcp::service::ServiceError::McpError(err))) => {
                // The upstream refused the request itself: the tool did not run.
                let text = format!("the tool's server refused the call: {}", err.message);
                ("error", Value::Null, Some(text.clone()), refusal(text))
            }
            Ended::Done(Err(err)) => {
                let text = format!(
                    "the tool's server failed mid-call ({err}); it may or may not have acted"
                );
                ("unknown", Value::Null, Some(text.clone()), refusal(text))
            }
            Ended::ByClient => {
                let text = "cancelled by the client (notifications/cancelled) while the tool ran; it may or may not have acted".to_string();
                ("unknown", Value::Null, Some(text.clone()), refusal(text))
            }
            Ended::ByRun => {
                let text = "the run was stopped on estop while the tool ran; the call was cancelled and may or may not have acted. Make no further tool calls.".to_string();
                ("unknown", Value::Null, Some(text.clone()), refusal(text))
            }
        };
        let mut req = json!({"op": "complete", "run": self.inner.run, "key": key,
            "token": token, "outcome": outcome});
        if !result.is_null() {
            req["result"] = result;
        }
        if let Some(err) = error {
            req["error"] = json!(err);
        }
        // A completion the gate could not take is a fact lost: say so rather than hide it.
        if let Err(e) = self.gate(req).await {
            eprintln!(
                "estop mcp: cannot record the completion of {key}: {}",
                e.message
            );
        }
        answer
    }
}

impl ServerHandler for Gateway {
    fn get_info(&self) -> ServerConfig {
        let mut caps = ServerCapabilities::builder().enable_tools().build();
        let (resources, prompts) = self.inner.offers;
        if resources {
            caps.resources = Some(Default::default());
        }
        if prompts {
            caps.prompts = Some(Default::default());
        }
        ServerConfig::new(caps).with_instructions(
            "Every tool call passes estop's gate: a call may be held for a human's approval or \
             refused; the result then says why and what to do.",
        )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        Ok(ListToolsResult::with_all_items(self.refresh().await?))
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, McpError> {
        let (all, routes) = crate::passthrough::resources(&self.inner.upstreams).await?;
        *self.inner.routes.lock().expect("not poisoned") = routes;
        Ok(ListResourcesResult::with_all_items(all))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, McpError> {
        let route = |g: &Gateway| {
            g.inner
                .routes
                .lock()
                .expect("not poisoned")
                .get(&request.uri)
                .copied()
        };
        let route = match route(self) {
            Some(r) => r,
            None => {
                let (_, routes) = crate::passthrough::resources(&self.inner.upstreams).await?;
                *self.inner.routes.lock().expect("not poisoned") = routes;
                route(self).ok_or_else(|| {
                    McpError::resource_not_found(format!("no resource {:?}", request.uri), None)
                })?
            }
        };
        crate::passthrough::read(&self.inner.upstreams, route, request).await
    }

    async fn list_prompts(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListPromptsResult, McpError> {
        let all = crate::passthrough::prompts(&self.inner.upstreams).await?;
        Ok(ListPromptsResult::with_all_items(all))
    }

    async fn get_prompt(
        &self,
        request: GetPromptRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<GetPromptResponse, McpError> {
        crate::passthrough::get_prompt(&self.inner.upstreams, request).await
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let name = request.name.to_string();
        let e = self.entry(&name).await?;
        if *self.inner.fence.borrow() {
            return Ok(refusal(format!(
                "REFUSED, not run: the run {} is stopped; make no further tool calls.",
                self.inner.run
            ))
            .into());
        }
        let args = Value::Object(request.arguments.clone().unwrap_or_default());
        let tool = estop_kernel::ids::ToolName::new(&name)
            .map_err(|err| McpError::invalid_params(format!("tool name {name:?}: {err}"), None))?;
        let digest = estop_protocol::digest_of(&tool, &args).to_hex();
        let trusted = self.inner.upstreams[e.upstream].trusted;
        let key = self.key(&request, &context.meta, &digest, &e, trusted);
        let token = match self.admit(&name, &key, &args, &e, &context.ct).await? {
            Admission::Go { token } => token,
            Admission::Answer(r) => return Ok(r.into()),
        };
        let mut params = CallToolRequestParams::new(e.tool.name.clone());
        params.arguments = request.arguments;
        let ended = self.forward(&e, params, &context.ct).await;
        Ok(self.complete(&key, &token, ended).await.into())
    }
}
