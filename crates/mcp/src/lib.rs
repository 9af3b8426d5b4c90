//! `estop mcp`: an MCP server over stdio that fronts upstream MCP servers and admits every
//! `tools/call` through estop's gate as an effect (docs/MCP.md).

pub mod config;
pub mod gateway;
pub mod passthrough;
pub mod pins;
pub mod upstream;

use anyhow::{Context, Result};
use estop_egress::gate::Gate;
use rmcp::ServiceExt;
use serde_json::{Value, json};
use std::path::PathBuf;
use tokio::sync::watch;

#[derive(Debug, Clone)]
pub struct Options {
    /// The gateway's configuration (TOML: `[gateway]`, `[[server]]`).
    pub config: PathBuf,
    /// The daemon's data directory (socket, agent token, and the pin file).
    pub data: PathBuf,
    pub socket: Option<String>,
    pub token: Option<String>,
    /// The run every call belongs to (default: a fresh `mcp-…` per session).
    pub run: Option<String>,
    pub parent: Option<String>,
}

/// Serves MCP on stdin/stdout until the client closes it.
pub fn serve_stdio(opts: Options) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(serve_io(opts, rmcp::transport::stdio()))
}

/// Serves MCP on the byte stream `io` (read half, write half) until the client closes it.
pub async fn serve_io<R, W>(opts: Options, io: (R, W)) -> Result<()>
where
    R: tokio::io::AsyncRead + Send + Unpin + 'static,
    W: tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let config = config::Config::load(&opts.config)?;
    let socket = opts
        .socket
        .clone()
        .unwrap_or_else(|| opts.data.join("estop.sock").display().to_string());
    let token = match &opts.token {
        Some(t) => t.clone(),
        None => std::fs::read_to_string(opts.data.join("agent.token"))
            .context("cannot read DATA/agent.token (pass --token or ESTOP_TOKEN)")?
            .trim()
            .to_string(),
    };
    let (gate, events) = Gate::connect(&socket, &token).await?;
    let pins = pins::Pins::open(&opts.data.join("mcp-pins.json"))?;
    let mut upstreams = Vec::new();
    for s in &config.servers {
        upstreams.push(upstream::Upstream::start(s).await?);
    }
    let run = opts.run.clone().unwrap_or_else(fresh_run);
    let (fence, _) = watch::channel(false);
    tokio::spawn(watch_run(gate.clone(), run.clone(), events, fence.clone()));
    let gateway = gateway::Gateway::new(
        upstreams,
        pins,
        gate,
        run,
        opts.parent.clone(),
        config.gateway.hold_ms,
        fence,
    );
    let service = gateway
        .serve(io)
        .await
        .context("the MCP client did not complete initialization")?;
    service.waiting().await?;
    Ok(())
}

fn fresh_run() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("mcp-{nanos:x}-{}", std::process::id())
}

/// Follows the run's events (the gateway subscribes once the run exists, at its first
/// admission): once the run is stopped, the fence is up and calls in flight are cut.
async fn watch_run(
    gate: Gate,
    run: String,
    mut events: tokio::sync::mpsc::UnboundedReceiver<Value>,
    fence: watch::Sender<bool>,
) {
    while let Some(ev) = events.recv().await {
        if ev["run"] != run.as_str() {
            continue;
        }
        let stop = ["cancelled", "closed", "finalizing", "settled"];
        if stop.contains(&ev["event"].as_str().unwrap_or("")) {
            check(&gate, &run, &fence).await;
        }
    }
}

/// Raises the fence if the run is stopped.
pub(crate) async fn check(gate: &Gate, run: &str, fence: &watch::Sender<bool>) {
    if let Ok(v) = gate.call(json!({"op": "status", "run": run})).await
        && v["ok"] == true
        && !v.get("cause").is_none_or(Value::is_null)
    {
        fence.send_replace(true);
    }
}
