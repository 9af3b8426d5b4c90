//! `estop mcp`: an MCP server over stdio or streamable HTTP that fronts upstream MCP servers
//! and admits every `tools/call` through estop's gate as an effect (docs/MCP.md).

pub mod book;
pub mod config;
pub mod front;
pub mod gateway;
pub mod passthrough;
pub mod pins;
pub mod principal;
pub mod sep1686;
pub mod upstream;

use anyhow::{Context, Result};
use rmcp::ServiceExt;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Debug, Clone)]
pub struct Options {
    /// The gateway's configuration (TOML: `[gateway]`, `[runs]`, `[http]`, `[[server]]`).
    pub config: PathBuf,
    /// The daemon's data directory (socket, agent token, and the pin file).
    pub data: PathBuf,
    pub socket: Option<String>,
    /// The agent token of the stdio front (over HTTP each client presents its own).
    pub token: Option<String>,
    /// The run every call belongs to (default: a fresh `mcp-…` per session).
    pub run: Option<String>,
    pub parent: Option<String>,
    /// The `estop` binary that starts `sandbox = true` upstreams (`estop run`); default this
    /// process's own executable.
    pub estop: Option<PathBuf>,
}

impl Options {
    fn socket(&self) -> String {
        self.socket
            .clone()
            .unwrap_or_else(|| self.data.join("estop.sock").display().to_string())
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// Serves MCP on stdin/stdout until the client closes it.
pub fn serve_stdio(opts: Options) -> Result<()> {
    runtime()?.block_on(serve_io(opts, rmcp::transport::stdio()))
}

/// Serves MCP over streamable HTTP on `listen` until the process is stopped.
pub fn serve_http(opts: Options, listen: &str) -> Result<()> {
    runtime()?.block_on(async {
        let config = config::Config::load(&opts.config)?;
        let addr: std::net::SocketAddr = listen
            .parse()
            .with_context(|| format!("--listen {listen:?}: give an IP address and port"))?;
        if !addr.ip().is_loopback() && !config.http.allow_remote {
            anyhow::bail!(
                "--listen {listen}: not a loopback address; set [http] allow_remote = true (and \
                 allowed_hosts) to serve other hosts, behind TLS"
            );
        }
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {listen}"))?;
        serve_http_on(opts, listener).await
    })
}

/// Serves MCP over streamable HTTP on `listener` (docs/MCP.md, "Over HTTP").
pub async fn serve_http_on(opts: Options, listener: tokio::net::TcpListener) -> Result<()> {
    let config = config::Config::load(&opts.config)?;
    let shared = start(&opts, &config).await?;
    eprintln!(
        "estop mcp: serving MCP on http://{}/mcp",
        listener.local_addr()?
    );
    front::serve(front::Front::new(shared, &config, &opts), listener).await
}

/// Serves MCP on the byte stream `io` (read half, write half) until the client closes it.
pub async fn serve_io<R, W>(opts: Options, io: (R, W)) -> Result<()>
where
    R: tokio::io::AsyncRead + Send + Unpin + 'static,
    W: tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let mut config = config::Config::load(&opts.config)?;
    // One principal on stdio: a share of the tasks would only shrink the bounds.
    config.gateway.tasks_per_principal_max = config.gateway.tasks_kept_max;
    let token = match &opts.token {
        Some(t) => t.clone(),
        None => std::fs::read_to_string(opts.data.join("agent.token"))
            .context("cannot read DATA/agent.token (pass --token or ESTOP_TOKEN)")?
            .trim()
            .to_string(),
    };
    let principal = principal::Principal::connect(&opts.socket(), &token).await?;
    let shared = start(&opts, &config).await?;
    let gateway = gateway::Gateway::new(
        shared.clone(),
        Some(principal),
        opts.run.clone(),
        opts.parent.clone(),
    );
    // 2025-11-25's own task form is carried at this edge (rmcp cannot parse it).
    let ours = Arc::new(move |id: &str| shared.is_1686(id));
    let service = gateway
        .serve(sep1686::edge(io, ours))
        .await
        .context("the MCP client did not complete initialization")?;
    service.waiting().await?;
    Ok(())
}

/// Opens the pins and starts (or connects to) every upstream.
async fn start(opts: &Options, config: &config::Config) -> Result<Arc<gateway::Shared>> {
    let pins = pins::Pins::open(&opts.data.join("mcp-pins.json"))?;
    let (changed, changes) = tokio::sync::mpsc::unbounded_channel();
    let estop = match &opts.estop {
        Some(path) => path.clone(),
        // Read only where needed: a gateway without sandboxed upstreams never runs it.
        None if config.servers.iter().any(|s| s.sandbox) => std::env::current_exe()
            .context("cannot find the estop binary that starts sandbox = true upstreams")?,
        None => PathBuf::new(),
    };
    let launch = Arc::new(upstream::Launch {
        estop,
        data: opts.data.clone(),
        socket: opts.socket.clone(),
        token: opts.token.clone(),
        run: opts.run.clone(),
        base: gateway::fresh_run(),
        tag: String::new(),
        env: None,
    });
    let mut upstreams = Vec::new();
    for (i, s) in config.servers.iter().enumerate() {
        let listener = upstream::Listener::new(i, changed.clone());
        upstreams.push(upstream::Upstream::start(s, launch.clone(), listener).await?);
    }
    let shared = gateway::Shared::new(upstreams, pins, config.gateway.clone(), config.runs.clone());
    tokio::spawn(gateway::follow_list_changes(
        Arc::downgrade(&shared),
        changes,
    ));
    Ok(shared)
}
