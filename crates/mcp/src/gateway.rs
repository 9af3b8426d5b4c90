//! The MCP server the agent talks to: tools of every upstream under `server__tool`, and every
//! `tools/call` admitted by the gate as an effect before the upstream is called.

use crate::book::{Book, Form, Full};
use crate::config::{Runs, SEPARATOR};
use crate::pins::{Pin, Pins, Seed, fingerprint};
use crate::principal::Principal;
use crate::sep1686;
use crate::upstream::{Change, Upstream};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, CompleteRequestParams, CompleteResult,
    ContentBlock, GetPromptRequestParams, GetPromptResponse, ListPromptsResult,
    ListResourceTemplatesResult, ListResourcesResult, ListToolsResult, PaginatedRequestParams,
    ReadResourceRequestParams, ReadResourceResponse, ServerCapabilities, ServerConfig,
    SubscribeRequestParams, Tool, UnsubscribeRequestParams,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData as McpError, ServerHandler};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// The `_meta` field a client may set to name a call's idempotency key itself.
pub const KEY_META: &str = "io.estop/key";
/// The `_meta` field that names a call's run, where `[runs] meta = true` lets it.
pub const RUN_META: &str = "io.estop/run";
/// The `_meta` field that says a call is a sub-agent's: it goes to the child run `RUN/NAME`.
pub const SUBAGENT_META: &str = "io.estop/subagent";

/// A recorded result larger than this is not kept (protocol v1 takes 64 KiB of `result`).
const RESULT_BYTES_MAX: usize = 60 * 1024;

/// How a completion's `error` says that the call never reached its tool: the same call made
/// again is then a new attempt (`Gateway::admit_attempt`).
const NOT_SENT: &str = "not sent: ";
/// Most attempts of one call that ended not sent; past them it is refused.
const ATTEMPTS_MAX: u32 = 8;
/// What the client adds to a request line: `,"id":` and a u64.
const ID_BYTES_MAX: usize = 26;

/// The bytes of `req`'s line to the gate, its id and newline included.
fn line_bytes(req: &Value) -> usize {
    req.to_string().len() + ID_BYTES_MAX + 1
}

/// One MCP session's handler: what every session shares, and the session's own run.
#[derive(Clone, Debug)]
pub struct Gateway {
    shared: Arc<Shared>,
    session: Arc<Session>,
}

/// What every session of the gateway shares: the upstreams, their tools and pins.
#[derive(Debug)]
pub struct Shared {
    upstreams: Vec<Upstream>,
    tools: Mutex<BTreeMap<String, Entry>>,
    pins: Mutex<Pins>,
    /// `[gateway]`: the hold and the tasks' bounds.
    bounds: crate::config::Gateway,
    hold_ms: u64,
    runs: Runs,
    /// Which upstream each resource URI and template belongs to, and who subscribed to what.
    routes: crate::passthrough::Routes,
    /// What any upstream offers (the front advertises only that).
    offers: crate::passthrough::Offers,
    /// Names this gateway process: the run of its stateless calls is `<instance>-<principal>`.
    instance: String,
    /// Held calls carried by tasks: SEP-2663's, and 2025-11-25's own form (`params.task`,
    /// SEP-1686) in the same store.
    tasks: Tasks,
    /// Whose each task is, which form, and the bounds on them (crate::book).
    book: Mutex<Book>,
    /// The client sessions to tell when an upstream's tools, resources or prompts change.
    peers: Mutex<Vec<rmcp::Peer<RoleServer>>>,
    /// The open `subscriptions/listen` streams (2026-07-28) to tell the same, by id.
    listeners: Mutex<BTreeMap<u64, rmcp::service::SubscriptionSink>>,
}

/// Most distinct resource URIs whose `notifications/resources/updated` one pass forwards; more
/// at once are dropped (a client re-reads what it subscribed to at its next update anyway).
const UPDATES_BATCH_MAX: usize = 1024;
/// Most notifications one pass takes off the queue before acting on them.
const CHANGES_PASS_MAX: usize = 4096;

/// How many client sessions are told of tool changes; a session beyond is not told.
const PEERS_MAX: usize = 1024;

/// Follows what the upstreams say changed. Tools are listed again at once (so a rewritten tool
/// is re-held by its pin before any call), resources and templates too (so their routes are
/// current); then every client session is told of each kind that changed, and each resource
/// update goes to the sessions subscribed to it. Ends with the gateway.
pub async fn follow_list_changes(
    shared: std::sync::Weak<Shared>,
    mut changes: tokio::sync::mpsc::UnboundedReceiver<(usize, Change)>,
) {
    while let Some(first) = changes.recv().await {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        // Several at once: one listing of each kind covers them.
        let mut lists = std::collections::BTreeSet::new();
        let mut updates = std::collections::BTreeSet::new();
        let mut next = Some(first);
        let mut taken = 0;
        while let Some((from, change)) = next {
            // A bounded pass: an upstream that never stops talking still gets served in turns.
            taken += 1;
            match change {
                Change::Updated(uri) if updates.len() < UPDATES_BATCH_MAX => {
                    updates.insert((from, uri));
                }
                Change::Updated(_) => {}
                kind => {
                    lists.insert(kind);
                }
            }
            next = (taken < CHANGES_PASS_MAX)
                .then(|| changes.try_recv().ok())
                .flatten();
        }
        shared.relist(&lists).await;
        shared.tell_clients(&lists).await;
        for (from, uri) in updates {
            crate::passthrough::updated(&shared.upstreams, &shared.routes, from, &uri).await;
        }
    }
}

/// rmcp's task store (it has no `Debug`).
#[derive(Default)]
struct Tasks(rmcp::task_manager::TaskManager);

impl std::fmt::Debug for Tasks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tasks({} running)", self.0.running_task_count())
    }
}

#[derive(Debug)]
struct Session {
    /// On stdio, the one principal; over HTTP each request brings its own (`None` here).
    principal: Option<Arc<Principal>>,
    /// The operator's `--run`, which no header or `_meta` overrides.
    fixed: Option<String>,
    /// This session's own run (a fresh `mcp-…`), when nothing else names one.
    own: String,
    /// Unique in the process: names the session's resource subscriptions.
    id: u64,
    parent: Option<String>,
    /// Calls of trusted read-only tools get a fresh key each (a re-read is not a replay).
    reads: AtomicU64,
}

static SESSIONS: AtomicU64 = AtomicU64::new(0);

/// Where a call goes: whose it is, and in which run.
#[derive(Clone)]
struct Place {
    principal: Arc<Principal>,
    run: String,
    parent: Option<String>,
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
    Go {
        token: String,
    },
    /// Still held after the bounded wait: what the model reads if no task can carry the wait.
    Held(CallToolResult),
    Answer(CallToolResult),
}

/// A fresh run name: unique to this process and moment.
pub fn fresh_run() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let n = N.fetch_add(1, Ordering::Relaxed);
    format!("mcp-{nanos:x}-{}-{n}", std::process::id())
}

impl Shared {
    /// Lists every upstream's tools again, checking each against its pin.
    pub async fn refresh(&self) -> Result<Vec<Tool>, McpError> {
        let mut listed = BTreeMap::new();
        for (i, up) in self.upstreams.iter().enumerate() {
            let failed = |e: String| McpError::internal_error(e, None);
            let peer = up.peer().await.map_err(failed)?;
            let tools = peer
                .list_all_tools()
                .await
                .map_err(|e| failed(format!("upstream {:?}: {e}", up.name)))?;
            for tool in tools {
                let name = format!("{}{SEPARATOR}{}", up.name, tool.name);
                let pin = self
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
        *self.tools.lock().expect("not poisoned") = listed;
        Ok(out)
    }

    /// Lists again what changed upstream (tools against their pins, resource routes).
    async fn relist(&self, lists: &std::collections::BTreeSet<Change>) {
        let failed = |what: &str, e: McpError| {
            eprintln!(
                "estop mcp: listing {what} after a change failed: {}",
                e.message
            );
        };
        if lists.contains(&Change::Tools)
            && let Err(e) = self.refresh().await
        {
            failed("tools", e);
        }
        if lists.contains(&Change::Resources) {
            let (up, routes) = (&self.upstreams, &self.routes);
            if let Err(e) = crate::passthrough::resources(up, routes).await {
                failed("resources", e);
            }
            if let Err(e) = crate::passthrough::templates(up, routes).await {
                failed("resource templates", e);
            }
        }
    }

    /// Tells every client session which lists changed (dropping sessions that are gone).
    async fn tell_clients(&self, lists: &std::collections::BTreeSet<Change>) {
        let peers: Vec<_> = {
            let mut peers = self.peers.lock().expect("not poisoned");
            peers.retain(|p| !p.is_transport_closed());
            peers.clone()
        };
        let sinks: Vec<_> = {
            let listeners = self.listeners.lock().expect("not poisoned");
            listeners.values().cloned().collect()
        };
        for sink in sinks {
            for kind in lists {
                // The sink sends only what the stream accepted (it refuses the rest).
                let _ = match kind {
                    Change::Tools => sink.notify_tool_list_changed().await,
                    Change::Resources => sink.notify_resource_list_changed().await,
                    Change::Prompts => sink.notify_prompt_list_changed().await,
                    _ => Ok(()),
                };
            }
        }
        for p in peers {
            for kind in lists {
                let _ = match kind {
                    Change::Tools => p.notify_tool_list_changed().await,
                    Change::Resources if self.offers.resources => {
                        p.notify_resource_list_changed().await
                    }
                    Change::Prompts if self.offers.prompts => p.notify_prompt_list_changed().await,
                    _ => Ok(()),
                };
            }
        }
    }

    /// Whether `owner` may have another task now (`Book::room`: the running and kept bounds,
    /// and its share), `book` locked: the caller takes the slot under the same lock.
    fn task_room(&self, book: &mut Book, owner: &str) -> Result<(), Full> {
        let running = self.tasks.0.running_task_count();
        let store = |id: &str| self.tasks.0.get_task(id).ok().map(|_| ());
        book.room(owner, &self.bounds, running, &store)
    }

    /// Whether `id` names a task of 2025-11-25's own form (the edge renames its requests).
    pub fn is_1686(&self, id: &str) -> bool {
        let book = self.book.lock().expect("not poisoned");
        book.get(id)
            .is_some_and(|k| matches!(k.form, Form::Own { .. }))
    }

    pub fn new(
        upstreams: Vec<Upstream>,
        pins: Pins,
        bounds: crate::config::Gateway,
        runs: Runs,
    ) -> Arc<Shared> {
        Arc::new(Shared {
            offers: crate::passthrough::offers(&upstreams),
            routes: Default::default(),
            upstreams,
            tools: Mutex::new(BTreeMap::new()),
            pins: Mutex::new(pins),
            hold_ms: bounds.hold_ms,
            bounds,
            runs,
            instance: fresh_run(),
            tasks: Default::default(),
            book: Mutex::new(Book::default()),
            peers: Mutex::new(Vec::new()),
            listeners: Mutex::new(BTreeMap::new()),
        })
    }
}

impl Gateway {
    /// A session's handler. `principal`: the stdio session's; `None` over HTTP, where each
    /// request carries its caller. `run`: the operator's `--run`, else a fresh one per session.
    pub fn new(
        shared: Arc<Shared>,
        principal: Option<Arc<Principal>>,
        run: Option<String>,
        parent: Option<String>,
    ) -> Gateway {
        Gateway {
            shared,
            session: Arc::new(Session {
                principal,
                fixed: run,
                own: fresh_run(),
                id: SESSIONS.fetch_add(1, Ordering::Relaxed),
                parent,
                reads: 0.into(),
            }),
        }
    }

    async fn refresh(&self) -> Result<Vec<Tool>, McpError> {
        self.shared.refresh().await
    }

    async fn entry(&self, name: &str) -> Result<Entry, McpError> {
        if let Some(e) = self.shared.tools.lock().expect("not poisoned").get(name) {
            return Ok(e.clone());
        }
        self.refresh().await?;
        let tools = self.shared.tools.lock().expect("not poisoned");
        tools.get(name).cloned().ok_or_else(|| {
            McpError::invalid_params(format!("no tool {name:?} (see tools/list)"), None)
        })
    }

    /// The effect's key within the run: the client's own (`_meta["io.estop/key"]`), else the
    /// call's digest, so the same call repeated in the session is the same effect.
    fn key(
        &self,
        meta: &rmcp::model::RequestMetaObject,
        digest: &str,
        e: &Entry,
        trusted: bool,
    ) -> String {
        let own = meta.0.get(KEY_META).and_then(Value::as_str);
        if let Some(k) = own {
            return format!("mcp:{k}");
        }
        if trusted && e.seed.read_only {
            let n = self.session.reads.fetch_add(1, Ordering::Relaxed);
            return format!("mcp:{digest}:read-{}-{n}", self.session.own);
        }
        format!("mcp:{digest}")
    }

    /// The call's principal and run: the operator's `--run`; else the configured header or
    /// `_meta["io.estop/run"]`; else the session's own run (over HTTP without a session, the
    /// 2026-07-28 revision, the principal's run in this gateway). A sub-agent's call
    /// (`_meta["io.estop/subagent"]`) goes to the child run `RUN/NAME` with `RUN` its parent.
    fn place(
        &self,
        meta: &rmcp::model::RequestMetaObject,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<Place, McpError> {
        let parts = ctx.extensions.get::<http::request::Parts>();
        let principal = match (&self.session.principal, parts) {
            (Some(p), _) => p.clone(),
            (None, Some(parts)) => parts
                .extensions
                .get::<Arc<Principal>>()
                .cloned()
                .ok_or_else(|| McpError::internal_error("an unauthenticated request", None))?,
            (None, None) => return Err(McpError::internal_error("no caller", None)),
        };
        let header = |name: &str| {
            parts
                .and_then(|p| p.headers.get(name))
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let from_meta = |key: &str| meta.0.get(key).and_then(Value::as_str).map(str::to_string);
        let named = self
            .shared
            .runs
            .header
            .as_deref()
            .and_then(header)
            .or_else(|| self.shared.runs.meta.then(|| from_meta(RUN_META)).flatten());
        let sessionless = parts.is_some() && header("mcp-session-id").is_none();
        let run = match (&self.session.fixed, named) {
            (Some(run), _) => run.clone(),
            (None, Some(run)) => run,
            (None, None) if sessionless => format!("{}-{}", self.shared.instance, principal.name),
            (None, None) => self.session.own.clone(),
        };
        Ok(match from_meta(SUBAGENT_META) {
            Some(name) => {
                let ok = (1..=64).contains(&name.len())
                    && name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
                if !ok {
                    return Err(McpError::invalid_params(
                        format!("_meta[\"{SUBAGENT_META}\"] {name:?}: use 1-64 of [A-Za-z0-9._-]"),
                        None,
                    ));
                }
                Place {
                    principal,
                    run: format!("{run}/{name}"),
                    parent: Some(run),
                }
            }
            None => Place {
                principal,
                run,
                parent: self.session.parent.clone(),
            },
        })
    }
}

/// A result the model reads: what happened, and what to do instead.
fn refusal(text: String) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(text)])
}

impl Gateway {
    /// Asks the gate to admit the call; with `wait`, waits up to `hold_ms` while it is held
    /// (cut short by that token: the client's cancel).
    async fn admit(
        &self,
        at: &Place,
        name: &str,
        key: &mut String,
        args: &Value,
        e: &Entry,
        wait: Option<&tokio_util::sync::CancellationToken>,
    ) -> Result<Admission, McpError> {
        let mut labels = e.seed.labels();
        labels["mcp.server"] = json!(self.shared.upstreams[e.upstream].name);
        let changed = matches!(e.pin, Pin::Changed { .. });
        if changed {
            labels["mcp.pin"] = json!("changed: approving accepts the tool's new description");
        }
        let run = &at.run;
        let mut admit = json!({"op": "admit", "run": run, "key": key, "tool": name,
            "args": args, "start": true, "labels": labels, "needs_approval": changed});
        if let Some(p) = &at.parent {
            admit["parent"] = json!(p);
        }
        if self.shared.upstreams[e.upstream].trusted {
            // The gate honours a seed only where it is stricter than policy's default, so a
            // trusted server's read-only hint changes nothing there; a destructive one fills
            // what no rule set (docs/PROTOCOL.md, `seed`).
            admit["seed"] = json!({"class": e.seed.class(),
                "reversibility": e.seed.reversibility()});
        }
        let v = self.admit_attempt(at, admit, key).await?;
        if let Some(ct) = wait
            && v["ok"] == true
            && v["verdict"] == "held"
        {
            return self.wait_held(at, name, key, e, ct).await;
        }
        self.interpret(at, name, key, e, v).await
    }

    /// Sends `admit` under `key`, or under the next attempt's key (`KEY~2`, `KEY~3`, …) while
    /// the gate says the call under the current one ended not sent (a held call its client
    /// cancelled and an operator approved after): that call never
    /// happened, so the same call made again is a new effect, admitted afresh. Past
    /// `ATTEMPTS_MAX` the call is refused. A line over the gate's bound is never sent.
    async fn admit_attempt(
        &self,
        at: &Place,
        mut admit: Value,
        key: &mut String,
    ) -> Result<Value, McpError> {
        let base = key.clone();
        for attempt in 1..=ATTEMPTS_MAX {
            if attempt > 1 {
                *key = format!("{base}~{attempt}");
                admit["key"] = json!(key);
            }
            self.fits(&admit)?;
            let v = gate(at, admit.clone()).await?;
            let not_sent = v["ok"] == true
                && v["verdict"] == "duplicate"
                && v["outcome"] == "error"
                && v["error"].as_str().is_some_and(|e| e.starts_with(NOT_SENT));
            if !not_sent {
                return Ok(v);
            }
        }
        Err(McpError::invalid_request(
            format!(
                "this call ended not sent {ATTEMPTS_MAX} times (key {base}); it is not tried \
                 again under it: use a new `_meta[\"{KEY_META}\"]` to make a new call"
            ),
            None,
        ))
    }

    /// Refuses a request whose line would be over the gate's `line_bytes_max`: the gate would
    /// discard it unread and answer with no id (docs/PROTOCOL.md, "Framing").
    fn fits(&self, req: &Value) -> Result<(), McpError> {
        let max = self.shared.bounds.line_bytes_max;
        let bytes = line_bytes(req);
        if bytes <= max {
            return Ok(());
        }
        Err(McpError::invalid_params(
            format!(
                "this call is too large for estop's gate: its admission is {bytes} bytes, over \
                 the gate's line_bytes_max ({max} bytes). It was not admitted and nothing was \
                 sent to the tool; send smaller arguments (a reference to the data, not the data)"
            ),
            None,
        ))
    }

    /// The bounded wait of a held call: up to `hold_ms` (cut short by `ct`, the client's
    /// cancel), then what the gate says.
    async fn wait_held(
        &self,
        at: &Place,
        name: &str,
        key: &str,
        e: &Entry,
        ct: &tokio_util::sync::CancellationToken,
    ) -> Result<Admission, McpError> {
        let Some(v) = self.wait_or_settle(at, key, ct.cancelled()).await? else {
            return Ok(Admission::Answer(refusal(
                "the call was cancelled while it was held; nothing was run".into(),
            )));
        };
        self.interpret(at, name, key, e, v).await
    }

    /// One `wait` (up to `hold_ms`) for a held call, or `None` once `cancelled` (the client's
    /// cancel) comes first. A cut wait is still the gate's, which may yet answer it
    /// `admitted` — an operator approved meanwhile, and that admission started the call — so
    /// its reply is read to the end by a task of its own, which completes such a call as not
    /// sent ([`Gateway::settle_abandoned`]).
    async fn wait_or_settle(
        &self,
        at: &Place,
        key: &str,
        cancelled: impl std::future::Future<Output = ()>,
    ) -> Result<Option<Value>, McpError> {
        let wait = json!({"op": "wait", "run": at.run, "key": key,
            "timeout_ms": self.shared.hold_ms});
        let reply = at.principal.gate.send(wait).map_err(unreachable)?;
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        let (me, place, owned) = (self.clone(), at.clone(), key.to_string());
        tokio::spawn(async move {
            // Sent back unless the waiter is gone: then the reply is this task's to settle.
            if let Err(v) = tx.send(reply.await) {
                me.settle_abandoned(&place, &owned, v).await;
            }
        });
        tokio::select! {
            biased;
            v = &mut rx => {
                let v = v.map_err(|_| unreachable(anyhow::anyhow!("the wait was dropped")))?;
                Ok(Some(v.map_err(unreachable)?))
            }
            () = cancelled => {
                rx.close();
                // A reply that came in between is settled here instead.
                if let Ok(v) = rx.try_recv() {
                    let (me, place, owned) = (self.clone(), at.clone(), key.to_string());
                    tokio::spawn(async move { me.settle_abandoned(&place, &owned, v).await });
                }
                Ok(None)
            }
        }
    }

    /// The end of a wait nobody listens to any more: an admission (it started the call) is
    /// completed at once as not sent; anything else (still held, refused) leaves nothing to do.
    async fn settle_abandoned(&self, at: &Place, key: &str, v: anyhow::Result<Value>) {
        let Ok(v) = v else { return };
        if v["ok"] == true
            && v["verdict"] == "admitted"
            && let Some(token) = v["token"].as_str()
        {
            self.complete(at, key, token, Ended::Abandoned).await;
        }
    }

    /// Runs an admitted call on its upstream and records how it ended.
    #[allow(clippy::too_many_arguments)]
    async fn run(
        &self,
        at: &Place,
        key: &str,
        token: &str,
        e: &Entry,
        arguments: Option<serde_json::Map<String, Value>>,
        ct: &tokio_util::sync::CancellationToken,
        fence: watch::Receiver<bool>,
    ) -> CallToolResponse {
        let mut params = CallToolRequestParams::new(e.tool.name.clone());
        params.arguments = arguments;
        let ended = self.forward(e, params, ct, fence).await;
        self.complete(at, key, token, ended).await.into()
    }

    /// What the gate's answer to an `admit` or a `wait` means for the call.
    async fn interpret(
        &self,
        at: &Place,
        name: &str,
        key: &str,
        e: &Entry,
        v: Value,
    ) -> Result<Admission, McpError> {
        let run = &at.run;
        if v["ok"] == true {
            // The run exists now: follow its stops (one that landed before is read at once).
            at.principal.follow_run(run).await.map_err(unreachable)?;
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
            "held" => Admission::Held(held(run, key, &v)),
            "duplicate" => Admission::Answer(replay(&v)),
            _ => Admission::Answer(refused(run, key, &v)),
        })
    }

    fn accept_pin(&self, name: &str, now: &str) -> Result<(), McpError> {
        self.shared
            .pins
            .lock()
            .expect("not poisoned")
            .accept(name, now)
            .map_err(|e| McpError::internal_error(format!("{e:#}"), None))?;
        if let Some(e) = self
            .shared
            .tools
            .lock()
            .expect("not poisoned")
            .get_mut(name)
        {
            e.pin = Pin::Same;
        }
        Ok(())
    }
}

fn unreachable(e: anyhow::Error) -> McpError {
    McpError::internal_error(
        format!("estop's gate is unreachable ({e:#}); nothing was run"),
        None,
    )
}

/// One request to the gate as the call's principal.
async fn gate(at: &Place, req: Value) -> Result<Value, McpError> {
    at.principal.gate.call(req).await.map_err(unreachable)
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

/// A held call, carried by a task until the operator decides.
struct Held {
    at: Place,
    name: String,
    key: String,
    e: Entry,
    arguments: Option<serde_json::Map<String, Value>>,
}

impl Gateway {
    /// Answers a held call with a task (SEP-2663) that waits for the operator's decision, then
    /// runs the call or reads the refusal; `tasks/cancel` ends the wait (nothing runs) or cuts
    /// the upstream call (recorded `unknown`). Gives the call back when no task can start
    /// (a bound or the principal's share is reached): it then gets the bounded wait.
    #[allow(clippy::result_large_err)] // the call given back, for the bounded wait
    fn task(
        &self,
        call: Held,
        held: CallToolResult,
        fence: watch::Receiver<bool>,
    ) -> Result<CallToolResponse, (Held, watch::Receiver<bool>)> {
        let owner = call.at.principal.name.clone();
        // The slot is checked and taken under one lock: concurrent calls cannot overrun it.
        let mut book = self.shared.book.lock().expect("not poisoned");
        if self.shared.task_room(&mut book, &owner).is_err() {
            return Err((call, fence));
        }
        let me = self.clone();
        let ttl = self.shared.bounds.task_ttl_ms;
        let options = rmcp::task_manager::TaskOptions::new()
            .with_ttl_ms(ttl)
            .with_status_message(format!(
                "held: an operator decides on estop's channel (`estop approve {} {}`)",
                call.at.run, call.key
            ));
        let task = self.shared.tasks.0.spawn(options, move |tctx| {
            let start = Admission::Held(held);
            Box::pin(async move { me.carry(call, start, fence, tctx).await })
        });
        let ttl = std::time::Duration::from_millis(ttl);
        book.keep(task.task_id.clone(), owner, Form::Extension, ttl);
        Ok(CallToolResponse::Task(rmcp::model::CreateTaskResult::new(
            task,
        )))
    }

    /// Carries a call from where admission left it (`start`): waits out a hold, runs it once
    /// admitted, and ends with what the client reads.
    async fn carry(
        &self,
        call: Held,
        start: Admission,
        fence: watch::Receiver<bool>,
        tctx: rmcp::task_manager::TaskContext,
    ) -> Result<CallToolResult, rmcp::task_manager::TaskExit> {
        use rmcp::task_manager::TaskExit;
        let Held {
            at,
            name,
            key,
            e,
            arguments,
        } = call;
        let mut next = start;
        let token = loop {
            match next {
                Admission::Go { token } => break token,
                Admission::Answer(r) => return Ok(r),
                Admission::Held(_) => {}
            }
            let Some(v) = self.wait_or_settle(&at, &key, tctx.cancelled()).await? else {
                return Err(TaskExit::Cancelled);
            };
            next = self.interpret(&at, &name, &key, &e, v).await?;
        };
        tctx.set_status_message("admitted: the tool runs");
        let ct = tokio_util::sync::CancellationToken::new();
        let (cut, watched) = (ct.clone(), tctx.clone());
        let watcher = tokio::spawn(async move {
            watched.cancelled().await;
            cut.cancel();
        });
        let mut params = CallToolRequestParams::new(e.tool.name.clone());
        params.arguments = arguments;
        let ended = self.forward(&e, params, &ct, fence).await;
        watcher.abort();
        let by_client = matches!(ended, Ended::ByClient);
        let result = self.complete(&at, &key, &token, ended).await;
        if by_client {
            return Err(TaskExit::Cancelled);
        }
        Ok(result)
    }

    /// The task `id` if it is the caller's: another principal's reads as unknown.
    fn own_task(&self, id: &str, ctx: &RequestContext<RoleServer>) -> Result<(), McpError> {
        let at = self.place(&Default::default(), ctx)?;
        let book = self.shared.book.lock().expect("not poisoned");
        match book.get(id) {
            Some(k) if k.owner == at.principal.name && k.form == Form::Extension => Ok(()),
            _ => Err(McpError::invalid_params(format!("no task {id:?}"), None)),
        }
    }
}

/// A call ready for admission: where it goes, which tool, its identity.
struct Prepared {
    at: Place,
    name: String,
    e: Entry,
    key: String,
    args: Value,
    fence: watch::Receiver<bool>,
}

/// A slot promised to a 2025-11-25 call while it is admitted; given back unless booked.
struct Slot<'a> {
    book: &'a Mutex<Book>,
    owner: String,
    open: bool,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if self.open {
            let mut book = self.book.lock().unwrap_or_else(|p| p.into_inner());
            book.unreserve(&self.owner);
        }
    }
}

/// How long telling a client of a task's end may take before it is given up.
const NOTIFY_MS: u64 = 5_000;
/// How often a 2025-11-25 client is asked to poll `tasks/get`.
const POLL_INTERVAL_MS: u64 = 1000;
/// Most tasks one `tasks/list` page holds.
const TASKS_PAGE_MAX: usize = 100;
/// How long `tasks/cancel` waits for the call to stop before it answers `cancelled`.
const CANCEL_SETTLE_MS: u64 = 10_000;

impl Gateway {
    /// What every `tools/call` goes through before admission: the tool, the call's place and
    /// key. `Err(answer)`: refused before admission (the run is stopped, the upstream is down).
    async fn prepare(
        &self,
        request: &CallToolRequestParams,
        context: &RequestContext<RoleServer>,
    ) -> Result<Result<Prepared, CallToolResult>, McpError> {
        let name = request.name.to_string();
        let e = self.entry(&name).await?;
        // rmcp hands a request's `_meta` to the handler in its context; the params may keep
        // it too: either will do.
        let meta = request.meta.clone().unwrap_or_else(|| context.meta.clone());
        let at = self.place(&meta, context)?;
        let fence = at
            .principal
            .fence(&at.run)
            .map_err(|why| McpError::invalid_request(why, None))?;
        if *fence.borrow() {
            return Ok(Err(refusal(format!(
                "REFUSED, not run: the run {} is stopped; make no further tool calls.",
                at.run
            ))));
        }
        // An upstream that is down (and not yet started again) refuses before admission.
        if let Err(why) = self.shared.upstreams[e.upstream].peer().await {
            return Ok(Err(refusal(format!(
                "DOWN, not run: {why}; nothing was sent."
            ))));
        }
        let args = Value::Object(request.arguments.clone().unwrap_or_default());
        let tool = estop_kernel::ids::ToolName::new(&name)
            .map_err(|err| McpError::invalid_params(format!("tool name {name:?}: {err}"), None))?;
        let digest = estop_protocol::digest_of(&tool, &args).to_hex();
        let trusted = self.shared.upstreams[e.upstream].trusted;
        let key = self.key(&meta, &digest, &e, trusted);
        Ok(Ok(Prepared {
            at,
            name,
            e,
            key,
            args,
            fence,
        }))
    }

    /// A task-augmented `tools/call` (2025-11-25): always answered with a task (the form asks
    /// for one), which carries the call from its admission: a held call waits for the operator,
    /// an admitted one runs, a refused one ends at once with the refusal. When no task can
    /// start (a bound of `[gateway]`, or the principal's share) it is refused before admission
    /// (`-32600`; nothing is recorded).
    async fn call_as_task(
        &self,
        params: Value,
        context: RequestContext<RoleServer>,
    ) -> Result<Value, McpError> {
        let ttl_max = self.shared.bounds.task_ttl_ms;
        let ttl_ms = params["task"]["ttl"]
            .as_u64()
            .map_or(ttl_max, |t| t.min(ttl_max));
        let request: CallToolRequestParams = serde_json::from_value(params)
            .map_err(|e| McpError::invalid_params(format!("tools/call: {e}"), None))?;
        let owner = self
            .place(&Default::default(), &context)?
            .principal
            .name
            .clone();
        // A slot is promised now (checked and taken under one lock), kept while the call is
        // admitted, and booked with the task: concurrent calls cannot overrun a bound.
        let mut slot = {
            let mut book = self.shared.book.lock().expect("not poisoned");
            if let Err(full) = self.shared.task_room(&mut book, &owner) {
                return Err(McpError::invalid_request(
                    format!(
                        "{full}: call again later, ask for a shorter `task.ttl`, or call \
                         without `task` (a bounded wait); nothing was run"
                    ),
                    None,
                ));
            }
            book.reserve(&owner);
            Slot {
                book: &self.shared.book,
                owner: owner.clone(),
                open: true,
            }
        };
        let (call, start, fence, says) = match self.prepare(&request, &context).await? {
            Err(answer) => {
                // Refused before admission: a task that has already ended.
                let (_, fence) = watch::channel(false);
                let says = text_of(&answer);
                (None, Admission::Answer(answer), fence, says)
            }
            Ok(mut p) => {
                let start = self
                    .admit(&p.at, &p.name, &mut p.key, &p.args, &p.e, None)
                    .await?;
                let says = match &start {
                    Admission::Go { .. } => "admitted: the tool runs".to_string(),
                    Admission::Held(r) | Admission::Answer(r) => text_of(r),
                };
                let Prepared {
                    at,
                    name,
                    e,
                    key,
                    fence,
                    ..
                } = p;
                let call = Held {
                    at,
                    name,
                    key,
                    e,
                    arguments: request.arguments,
                };
                (Some(call), start, fence, says)
            }
        };
        let status = match (&call, &start) {
            (Some(c), Admission::Held(_)) => format!(
                "held: an operator decides on estop's channel (`estop approve {} {}`)",
                c.at.run, c.key
            ),
            _ => says.clone(),
        };
        let options = rmcp::task_manager::TaskOptions::new()
            .with_ttl_ms(ttl_ms)
            .with_poll_interval_ms(POLL_INTERVAL_MS)
            .with_status_message(status);
        let me = self.clone();
        let peer = context.peer.clone();
        let mut book = self.shared.book.lock().expect("not poisoned");
        let task = self.shared.tasks.0.spawn(options, move |tctx| {
            Box::pin(async move {
                let id = tctx.task_id().to_string();
                let ended = match call {
                    Some(call) => me.carry(call, start, fence, tctx).await,
                    None => match start {
                        Admission::Answer(r) => Ok(r),
                        _ => unreachable!("only an answer comes without a call"),
                    },
                };
                tokio::spawn(async move { me.tell_status(&id, peer).await });
                ended
            })
        });
        book.unreserve(&owner);
        slot.open = false;
        let form = Form::Own { cancelled: false };
        let ttl = std::time::Duration::from_millis(ttl_ms);
        book.keep(task.task_id.clone(), owner, form, ttl);
        drop(book);
        let detailed = rmcp::model::DetailedTask::new(task, rmcp::model::TaskPayload::Working);
        Ok(json!({"task": task_1686(&detailed, false),
            "_meta": {"io.modelcontextprotocol/model-immediate-response": says}}))
    }

    /// Sends `notifications/tasks/status` once the task has settled in the store (its future
    /// returned just before): a few short looks, then nothing (the notification is optional).
    async fn tell_status(&self, id: &str, peer: rmcp::Peer<RoleServer>) {
        for _ in 0..100 {
            match self.shared.tasks.0.get_task(id) {
                Ok(d) if d.status().is_terminal() => {
                    let cancelled = self.cancelled_1686(id);
                    let n = rmcp::model::CustomNotification::new(
                        sep1686::STATUS,
                        Some(task_1686(&d, cancelled)),
                    );
                    // Bounded: a client that reads nothing must not keep this task alive.
                    let note = rmcp::model::ServerNotification::CustomNotification(n);
                    let _ = tokio::time::timeout(
                        std::time::Duration::from_millis(NOTIFY_MS),
                        peer.send_notification(note),
                    )
                    .await;
                    return;
                }
                Ok(_) => tokio::time::sleep(std::time::Duration::from_millis(5)).await,
                Err(_) => return,
            }
        }
    }

    fn cancelled_1686(&self, id: &str) -> bool {
        let book = self.shared.book.lock().expect("not poisoned");
        book.get(id)
            .is_some_and(|k| k.form == Form::Own { cancelled: true })
    }

    /// The caller's 2025-11-25 task `id`: another principal's reads as unknown.
    fn own_1686(
        &self,
        id: &str,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<rmcp::model::DetailedTask, McpError> {
        let at = self.place(&Default::default(), ctx)?;
        let mine = {
            let book = self.shared.book.lock().expect("not poisoned");
            book.get(id)
                .is_some_and(|k| k.owner == at.principal.name && matches!(k.form, Form::Own { .. }))
        };
        let unknown = || McpError::invalid_params(format!("no task {id:?}"), None);
        if !mine {
            return Err(unknown());
        }
        self.shared.tasks.0.get_task(id).map_err(|_| unknown())
    }

    /// `tasks/get`: the task (2025-11-25's `Task`).
    fn task_1686(&self, id: &str, ctx: &RequestContext<RoleServer>) -> Result<Value, McpError> {
        let d = self.own_1686(id, ctx)?;
        Ok(task_1686(&d, self.cancelled_1686(id)))
    }

    /// `tasks/result`: waits until the task ends (cut short by the client's cancel), then
    /// answers what the call answered.
    async fn result_1686(
        &self,
        id: &str,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<Value, McpError> {
        let d = loop {
            let d = self.own_1686(id, ctx)?;
            if d.status().is_terminal() || self.cancelled_1686(id) {
                break d;
            }
            // A poll of the in-process store, bounded by the task's TTL (past it the store
            // fails the task).
            tokio::select! {
                () = tokio::time::sleep(std::time::Duration::from_millis(20)) => {}
                () = ctx.ct.cancelled() => {
                    return Err(McpError::invalid_request("tasks/result was cancelled", None));
                }
            }
        };
        if self.cancelled_1686(id) {
            return Err(McpError::invalid_request(
                format!(
                    "task {id:?} was cancelled (tasks/cancel); estop's ledger records what the \
                     call did"
                ),
                None,
            ));
        }
        match d.payload {
            rmcp::model::TaskPayload::Completed { result } => {
                let mut result = Value::Object(result);
                result["_meta"]["io.modelcontextprotocol/related-task"] = json!({"taskId": id});
                Ok(result)
            }
            rmcp::model::TaskPayload::Failed { error } => {
                let code = error.get("code").and_then(Value::as_i64).unwrap_or(-32603);
                let message = error
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("the task failed")
                    .to_string();
                Err(McpError::new(
                    rmcp::model::ErrorCode(i32::try_from(code).unwrap_or(-32603)),
                    message,
                    None,
                ))
            }
            _ => Err(McpError::invalid_request(
                format!("task {id:?} was cancelled; nothing to return"),
                None,
            )),
        }
    }

    /// `tasks/cancel`: ends the wait (nothing runs) or cuts the upstream call (recorded
    /// `unknown`), and answers the task, `cancelled`. A task that has already ended is an
    /// invalid-params error, as the revision says.
    async fn cancel_1686(
        &self,
        id: &str,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<Value, McpError> {
        let d = self.own_1686(id, ctx)?;
        if d.status().is_terminal() || self.cancelled_1686(id) {
            let now = task_1686(&d, self.cancelled_1686(id));
            return Err(McpError::invalid_params(
                format!("task {id:?} has already ended ({})", now["status"]),
                None,
            ));
        }
        self.shared.tasks.0.cancel_task(id)?;
        // The call stops at once (a held wait) or after the upstream heard the cancel and the
        // gate recorded it: wait for that, bounded, so the answer follows the cut.
        let deadline =
            tokio::time::Instant::now() + std::time::Duration::from_millis(CANCEL_SETTLE_MS);
        while tokio::time::Instant::now() < deadline {
            match self.shared.tasks.0.get_task(id) {
                Ok(d) if !d.status().is_terminal() => {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
                _ => break,
            }
        }
        if let Some(k) = self.shared.book.lock().expect("not poisoned").get_mut(id) {
            k.form = Form::Own { cancelled: true };
        }
        let d = self.shared.tasks.0.get_task(id).unwrap_or(d);
        Ok(task_1686(&d, true))
    }

    /// `tasks/list`: the caller's tasks of this form, `TASKS_PAGE_MAX` a page; the cursor is
    /// the offset of the next page.
    fn list_1686(
        &self,
        params: &Value,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<Value, McpError> {
        let at = self.place(&Default::default(), ctx)?;
        let from = match params.get("cursor") {
            None | Some(Value::Null) => 0,
            Some(c) => c
                .as_str()
                .and_then(|c| c.parse::<usize>().ok())
                .ok_or_else(|| McpError::invalid_params(format!("no cursor {c}"), None))?,
        };
        let mine: Vec<(String, bool)> = {
            let book = self.shared.book.lock().expect("not poisoned");
            book.owned_by(&at.principal.name)
                .filter_map(|(id, k)| match k.form {
                    Form::Own { cancelled } => Some((id.clone(), cancelled)),
                    Form::Extension => None,
                })
                .collect()
        };
        let listed: Vec<Value> = mine
            .iter()
            .filter_map(|(id, cancelled)| {
                let d = self.shared.tasks.0.get_task(id).ok()?;
                Some(task_1686(&d, *cancelled))
            })
            .collect();
        let page: Vec<Value> = listed
            .iter()
            .skip(from)
            .take(TASKS_PAGE_MAX)
            .cloned()
            .collect();
        let mut out = json!({"tasks": page});
        if from + TASKS_PAGE_MAX < listed.len() {
            out["nextCursor"] = json!((from + TASKS_PAGE_MAX).to_string());
        }
        Ok(out)
    }
}

/// A task as 2025-11-25 shows it: a tool's `isError` result is `failed` there, and a task
/// `tasks/cancel` ended stays `cancelled`.
fn task_1686(d: &rmcp::model::DetailedTask, cancelled: bool) -> Value {
    use rmcp::model::TaskPayload;
    let t = &d.task;
    let (status, message) = match &d.payload {
        _ if cancelled => ("cancelled", Some("cancelled by tasks/cancel".to_string())),
        TaskPayload::Completed { result } if result.get("isError") == Some(&json!(true)) => {
            let said = serde_json::from_value::<CallToolResult>(Value::Object(result.clone()))
                .map(|r| text_of(&r))
                .ok();
            ("failed", said)
        }
        TaskPayload::Completed { .. } => ("completed", Some("done: tasks/result has it".into())),
        TaskPayload::Failed { .. } => ("failed", t.status_message.clone()),
        TaskPayload::Cancelled => ("cancelled", t.status_message.clone()),
        TaskPayload::InputRequired { .. } => ("input_required", t.status_message.clone()),
        _ => ("working", t.status_message.clone()),
    };
    let mut v = json!({"taskId": t.task_id, "status": status, "createdAt": t.created_at,
        "lastUpdatedAt": t.last_updated_at, "ttl": t.ttl_ms});
    if let Some(m) = message {
        v["statusMessage"] = json!(m);
    }
    if let Some(p) = t.poll_interval_ms {
        v["pollInterval"] = json!(p);
    }
    v
}

/// The text a result says (what the model would read).
fn text_of(r: &CallToolResult) -> String {
    r.content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect()
}

/// How an upstream call ended.
enum Ended {
    Done(Result<CallToolResult, rmcp::service::ServiceError>),
    /// The client sent `notifications/cancelled` (or went away).
    ByClient,
    /// The run was stopped on estop's side.
    ByRun,
    /// The upstream is down and could not be started again: nothing was sent to it.
    Down(String),
    /// Admitted after its client had cancelled it while it was held: nothing was sent.
    Abandoned,
}

impl Gateway {
    /// Calls the upstream, cut short by the client's cancel or the run's stop; dropping the
    /// upstream call sends `notifications/cancelled` to the upstream (rmcp's cancel-on-drop).
    async fn forward(
        &self,
        e: &Entry,
        params: CallToolRequestParams,
        ct: &tokio_util::sync::CancellationToken,
        mut fence: watch::Receiver<bool>,
    ) -> Ended {
        let peer = match self.shared.upstreams[e.upstream].peer().await {
            Ok(peer) => peer,
            Err(why) => return Ended::Down(why),
        };
        tokio::select! {
            r = peer.call_tool(params) => Ended::Done(r),
            () = ct.cancelled() => Ended::ByClient,
            _ = fence.wait_for(|stopped| *stopped) => Ended::ByRun,
        }
    }

    /// Reports what happened to the gate, and makes what the client gets.
    async fn complete(&self, at: &Place, key: &str, token: &str, ended: Ended) -> CallToolResult {
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
            Ended::Down(why) => {
                let text = format!("{why}; nothing was sent to the tool. Try again later.");
                ("error", Value::Null, Some(text.clone()), refusal(text))
            }
            Ended::Abandoned => {
                let text = format!(
                    "{NOT_SENT}the client cancelled the call while it was held, and an operator \
                     approved it after; nothing was sent to the tool"
                );
                ("error", Value::Null, Some(text.clone()), refusal(text))
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
        let mut req = json!({"op": "complete", "run": at.run, "key": key,
            "token": token, "outcome": outcome});
        if !result.is_null() {
            req["result"] = result;
        }
        if let Some(err) = error {
            req["error"] = json!(err);
        }
        if line_bytes(&req) > self.shared.bounds.line_bytes_max {
            // Kept within the gate's line (a long run or key leaves less room for the result).
            req["result"] = json!({"mcp_result_bytes_over": self.shared.bounds.line_bytes_max});
        }
        // A completion the gate could not take is a fact lost: say so rather than hide it.
        if let Err(e) = gate(at, req).await {
            eprintln!(
                "estop mcp: cannot record the completion of {key}: {}",
                e.message
            );
        }
        answer
    }
}

impl Gateway {
    /// A `tools/call` through the gate: admitted, held (a task, or the bounded wait), refused.
    async fn gated_call(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let p = match self.prepare(&request, &context).await? {
            Ok(p) => p,
            Err(answer) => return Ok(answer.into()),
        };
        // A client that takes tasks gets a held call as a task at once; others wait, bounded.
        let tasks = context
            .client_capabilities()
            .is_some_and(|c| c.supports_tasks());
        let Prepared {
            at,
            name,
            e,
            mut key,
            args,
            fence,
        } = p;
        let admission = self
            .admit(
                &at,
                &name,
                &mut key,
                &args,
                &e,
                (!tasks).then_some(&context.ct),
            )
            .await?;
        let token = match admission {
            Admission::Go { token } => token,
            Admission::Held(r) if !tasks => return Ok(r.into()),
            Admission::Held(r) => {
                let call = Held {
                    at,
                    name,
                    key,
                    e,
                    arguments: request.arguments,
                };
                let (call, fence) = match self.task(call, r, fence) {
                    Ok(task) => return Ok(task),
                    Err(back) => back,
                };
                // No task can carry it (a bound, or the principal's share): the bounded wait.
                let Held {
                    at,
                    name,
                    key,
                    e,
                    arguments,
                } = call;
                let token = match self.wait_held(&at, &name, &key, &e, &context.ct).await? {
                    Admission::Go { token } => token,
                    Admission::Held(r) | Admission::Answer(r) => return Ok(r.into()),
                };
                return Ok(self
                    .run(&at, &key, &token, &e, arguments, &context.ct, fence)
                    .await);
            }
            Admission::Answer(r) => return Ok(r.into()),
        };
        Ok(self
            .run(&at, &key, &token, &e, request.arguments, &context.ct, fence)
            .await)
    }
}

/// 2026-07-28 requires `resultType` on every result; one an upstream answered (at an older
/// revision, which has none) or one recorded from it lacks it. rmcp takes it off again for
/// peers of older revisions.
fn typed(result_type: &mut Option<rmcp::model::ResultType>) {
    result_type.get_or_insert(rmcp::model::ResultType::COMPLETE);
}

impl ServerHandler for Gateway {
    fn get_info(&self) -> ServerConfig {
        let mut caps = ServerCapabilities::builder()
            .enable_tools()
            .enable_tool_list_changed()
            .build();
        // Held calls become tasks for clients that declare the extension (SEP-2663).
        caps.extensions.get_or_insert_with(Default::default).insert(
            rmcp::model::TASKS_EXTENSION_ID.to_string(),
            Default::default(),
        );
        let offers = self.shared.offers;
        if offers.resources {
            // Changes are followed and passed on; subscriptions where an upstream takes them.
            let mut r = rmcp::model::ResourcesCapability::default();
            r.list_changed = Some(true);
            r.subscribe = offers.subscribe.then_some(true);
            caps.resources = Some(r);
        }
        if offers.prompts {
            let mut p = rmcp::model::PromptsCapability::default();
            p.list_changed = Some(true);
            caps.prompts = Some(p);
        }
        if offers.completions {
            caps.completions = Some(Default::default());
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
        let all =
            crate::passthrough::resources(&self.shared.upstreams, &self.shared.routes).await?;
        Ok(ListResourcesResult::with_all_items(all))
    }

    async fn list_resource_templates(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, McpError> {
        let (up, routes) = (&self.shared.upstreams, &self.shared.routes);
        let all = crate::passthrough::templates(up, routes).await?;
        Ok(ListResourceTemplatesResult::with_all_items(all))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, McpError> {
        let (up, routes) = (&self.shared.upstreams, &self.shared.routes);
        let route = routes.route(up, &request.uri).await?;
        let mut r = crate::passthrough::read(up, route, request).await?;
        if let ReadResourceResponse::Complete(r) = &mut r {
            typed(&mut r.result_type);
        }
        Ok(r)
    }

    async fn subscribe(
        &self,
        request: SubscribeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), McpError> {
        let (up, routes) = (&self.shared.upstreams, &self.shared.routes);
        let id = self.session.id;
        let who = crate::passthrough::Subscriber::Session(context.peer);
        crate::passthrough::subscribe(up, routes, id, who, request).await
    }

    async fn unsubscribe(
        &self,
        request: UnsubscribeRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<(), McpError> {
        let (up, routes) = (&self.shared.upstreams, &self.shared.routes);
        crate::passthrough::unsubscribe(up, routes, self.session.id, request).await
    }

    async fn complete(
        &self,
        request: CompleteRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CompleteResult, McpError> {
        let (up, routes) = (&self.shared.upstreams, &self.shared.routes);
        let mut r = crate::passthrough::complete(up, routes, request).await?;
        typed(&mut r.result_type);
        Ok(r)
    }

    async fn list_prompts(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListPromptsResult, McpError> {
        let all = crate::passthrough::prompts(&self.shared.upstreams).await?;
        Ok(ListPromptsResult::with_all_items(all))
    }

    async fn get_prompt(
        &self,
        request: GetPromptRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<GetPromptResponse, McpError> {
        let mut r = crate::passthrough::get_prompt(&self.shared.upstreams, request).await?;
        if let GetPromptResponse::Complete(r) = &mut r {
            typed(&mut r.result_type);
        }
        Ok(r)
    }

    /// 2026-07-28's `subscriptions/listen`: tool list changes always; resource and prompt list
    /// changes where an upstream offers them; updates of the URIs asked for that the gateway
    /// can route now (listed, or expanding a listed template) and whose upstream takes
    /// subscriptions. rmcp intersects this with what was asked and advertised.
    fn accepted_subscription_filter(
        &self,
        requested: &rmcp::model::SubscriptionFilter,
    ) -> Option<rmcp::model::SubscriptionFilter> {
        let offers = self.shared.offers;
        let mut accepted = rmcp::model::SubscriptionFilter::builder().tools_list_changed();
        if offers.resources {
            accepted = accepted.resources_list_changed();
        }
        if offers.prompts {
            accepted = accepted.prompts_list_changed();
        }
        let (up, routes) = (&self.shared.upstreams, &self.shared.routes);
        let uris = requested
            .resource_subscriptions
            .iter()
            .flatten()
            .filter(|uri| {
                routes.known(uri).is_some_and(|i| {
                    crate::passthrough::has(&up[i], crate::passthrough::subscribable)
                })
            });
        Some(accepted.resource_subscriptions(uris.cloned()).build())
    }

    /// One listen stream: its URIs' upstreams subscribed (once per URI, as for sessions), its
    /// list changes told with the sessions', all of it undone when the stream ends. At
    /// `PEERS_MAX` open streams one more is refused.
    async fn listen(&self, context: rmcp::service::SubscriptionContext) -> Result<(), McpError> {
        let id = SESSIONS.fetch_add(1, Ordering::Relaxed);
        {
            let mut listeners = self.shared.listeners.lock().expect("not poisoned");
            if listeners.len() >= PEERS_MAX {
                return Err(McpError::invalid_request(
                    format!("{PEERS_MAX} subscriptions/listen streams are open on this gateway"),
                    None,
                ));
            }
            listeners.insert(id, context.sink().clone());
        }
        let (up, routes) = (&self.shared.upstreams, &self.shared.routes);
        let uris = context.accepted().resource_subscriptions.clone();
        let mut subscribed = Vec::new();
        for uri in uris.iter().flatten() {
            let who = crate::passthrough::Subscriber::Listen(context.sink().clone());
            let params = SubscribeRequestParams::new(uri.clone());
            match crate::passthrough::subscribe(up, routes, id, who, params).await {
                Ok(()) => subscribed.push(uri.clone()),
                Err(e) => eprintln!(
                    "estop mcp: a listen stream's subscription to {uri} failed: {}",
                    e.message
                ),
            }
        }
        context.cancelled().await;
        self.shared
            .listeners
            .lock()
            .expect("not poisoned")
            .remove(&id);
        for uri in subscribed {
            if crate::passthrough::forget(routes, &uri, id)
                && let Some(i) = routes.known(&uri)
            {
                let params = UnsubscribeRequestParams::new(uri);
                let _ = crate::passthrough::unsubscribe_upstream(&up[i], params).await;
            }
        }
        Ok(())
    }

    async fn on_initialized(&self, context: rmcp::service::NotificationContext<RoleServer>) {
        let mut peers = self.shared.peers.lock().expect("not poisoned");
        peers.retain(|p| !p.is_transport_closed());
        if peers.len() < PEERS_MAX {
            peers.push(context.peer);
        }
    }

    async fn get_task(
        &self,
        request: rmcp::model::GetTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::GetTaskResult, McpError> {
        self.own_task(&request.task_id, &context)?;
        let task = self.shared.tasks.0.get_task(&request.task_id)?;
        Ok(rmcp::model::GetTaskResult::new(task))
    }

    async fn cancel_task(
        &self,
        request: rmcp::model::CancelTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), McpError> {
        self.own_task(&request.task_id, &context)?;
        self.shared.tasks.0.cancel_task(&request.task_id)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let mut r = self.gated_call(request, context).await?;
        if let CallToolResponse::Complete(r) = &mut r {
            typed(&mut r.result_type);
        }
        Ok(r)
    }

    /// 2025-11-25's task form, which the edge renamed for rmcp to pass whole (`sep1686.rs`).
    async fn on_custom_request(
        &self,
        request: rmcp::model::CustomRequest,
        context: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::CustomResult, McpError> {
        let params = request.params.clone().unwrap_or(Value::Null);
        let task_id = || {
            params["taskId"]
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| McpError::invalid_params("params.taskId: a string is needed", None))
        };
        let v = match request.method.as_str() {
            sep1686::CALL => self.call_as_task(params.clone(), context).await?,
            sep1686::GET => self.task_1686(&task_id()?, &context)?,
            sep1686::RESULT => self.result_1686(&task_id()?, &context).await?,
            sep1686::CANCEL => self.cancel_1686(&task_id()?, &context).await?,
            sep1686::LIST => self.list_1686(&params, &context)?,
            other => {
                return Err(McpError::new(
                    rmcp::model::ErrorCode::METHOD_NOT_FOUND,
                    other.to_string(),
                    None,
                ));
            }
        };
        Ok(rmcp::model::CustomResult::new(v))
    }
}
