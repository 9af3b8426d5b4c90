//! `estop bench mcp`: what `estop mcp` adds to a `tools/call`, against calling the same upstream
//! directly in the same run. The upstream is an rmcp server on loopback HTTP in this process
//! (one `echo` tool); the clients are rmcp's, each session one call at a time (closed loop),
//! each call with fresh arguments so every one through the gateway is a new effect: admitted
//! and completed durably by the daemon. Each row runs N sessions at once: N sessions to the
//! upstream directly, N gateways on stdio (a byte stream each, as N agents each running
//! `estop mcp`), N sessions on one gateway's streamable HTTP front.

use crate::percentile;
use rmcp::model::{CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData, ServerHandler, ServiceExt};
use std::path::PathBuf;
use std::time::Instant;

pub struct McpOptions {
    /// The daemon's socket and data directory (its agent token; the gateway's config and pins).
    pub socket: String,
    pub data: PathBuf,
    /// Calls per path and row, shared out over its sessions (each makes at least 10; a warm-up
    /// call per session is not counted: connection set-up).
    pub calls: usize,
    /// Concurrent sessions of each row (e.g. 1, 16, 64).
    pub sessions: Vec<usize>,
}

/// Calls each session makes, at least.
const SESSION_CALLS_MIN: usize = 10;

/// One path's figures: microseconds per call, and calls per second.
#[derive(Debug, Clone)]
pub struct Path {
    pub name: &'static str,
    /// Sessions calling at once.
    pub sessions: usize,
    pub calls: usize,
    pub p50_us: u32,
    pub p99_us: u32,
    pub calls_per_s: f64,
}

/// The upstream: `echo {text}` answers the text.
#[derive(Clone)]
struct Echo;

impl ServerHandler for Echo {
    fn get_info(&self) -> rmcp::model::ServerConfig {
        let caps = rmcp::model::ServerCapabilities::builder()
            .enable_tools()
            .build();
        rmcp::model::ServerConfig::new(caps)
    }

    async fn list_tools(
        &self,
        _request: Option<rmcp::model::PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::ListToolsResult, ErrorData> {
        let serde_json::Value::Object(schema) = serde_json::json!({"type": "object"}) else {
            unreachable!("an object literal")
        };
        let echo = rmcp::model::Tool::new("echo", "Echoes text.", std::sync::Arc::new(schema));
        Ok(rmcp::model::ListToolsResult::with_all_items(vec![echo]))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let text = request
            .arguments
            .and_then(|a| a.get("text").and_then(|t| t.as_str()).map(str::to_string))
            .unwrap_or_default();
        Ok(CallToolResult::success(vec![ContentBlock::text(text)]).into())
    }
}

/// Serves `Echo` over streamable HTTP on a loopback port: its `/mcp` URL.
async fn serve_upstream() -> anyhow::Result<String> {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService,
    };
    let service = StreamableHttpService::new(
        || Ok(Echo),
        std::sync::Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/mcp", listener.local_addr()?);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let service = hyper_util::service::TowerToHyperService::new(service.clone());
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(url)
}

type Client = rmcp::service::RunningService<rmcp::RoleClient, ()>;

/// Times `per` sequential `echo` calls on each of `clients` at once, after one warm-up call
/// each: every call's latency, and the calls per second of the whole.
async fn drive(name: &'static str, clients: Vec<Client>, per: usize) -> anyhow::Result<Path> {
    let sessions = clients.len();
    let tool = if name == "direct" { "echo" } else { "b__echo" };
    let call = move |client: &Client, text: String| {
        let mut p = CallToolRequestParams::new(tool);
        let serde_json::Value::Object(args) = serde_json::json!({ "text": text }) else {
            unreachable!("an object literal")
        };
        p.arguments = Some(args);
        let peer = client.peer().clone();
        async move {
            let r = peer.call_tool(p).await?;
            anyhow::ensure!(r.is_error != Some(true), "{name}: the call failed: {r:?}");
            Ok(())
        }
    };
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(sessions + 1));
    let mut tasks = tokio::task::JoinSet::new();
    for (s, client) in clients.into_iter().enumerate() {
        let start = start.clone();
        tasks.spawn(async move {
            call(&client, format!("{name}-{s}-warm")).await?;
            start.wait().await;
            let mut us = Vec::with_capacity(per);
            for i in 0..per {
                let t = Instant::now();
                call(&client, format!("{name}-{s}-{i}")).await?;
                us.push(u32::try_from(t.elapsed().as_micros()).unwrap_or(u32::MAX));
            }
            let _ = client.cancel().await;
            anyhow::Ok(us)
        });
    }
    start.wait().await;
    let started = Instant::now();
    let mut us = Vec::with_capacity(per * sessions);
    while let Some(done) = tasks.join_next().await {
        us.extend(done??);
    }
    let total = started.elapsed().as_secs_f64();
    us.sort_unstable();
    Ok(Path {
        name,
        sessions,
        calls: us.len(),
        p50_us: percentile(&us, 0.50),
        p99_us: percentile(&us, 0.99),
        calls_per_s: us.len() as f64 / total,
    })
}

/// For each row's session count: direct, through stdio gateways, through one gateway's HTTP
/// front, in that order, one run.
pub fn gateway_overhead(o: &McpOptions) -> anyhow::Result<Vec<Path>> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let url = serve_upstream().await?;
        let config = o.data.join("bench-mcp.toml");
        // Room for every row's sessions on the one HTTP front.
        let sessions_max: usize = o.sessions.iter().sum::<usize>() + 1;
        std::fs::write(
            &config,
            format!(
                "[http]\nsessions_max = {sessions_max}\n\n[[server]]\nname = \"b\"\nurl = {url:?}\n"
            ),
        )?;
        let opts = estop_mcp::Options {
            config,
            data: o.data.clone(),
            socket: Some(o.socket.clone()),
            token: None,
            run: None,
            parent: None,
            estop: None,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let front = format!("http://{}/mcp", listener.local_addr()?);
        let http = opts.clone();
        tokio::spawn(async move { estop_mcp::serve_http_on(http, listener).await });
        let token = std::fs::read_to_string(o.data.join("agent.token"))?;
        let mut out = Vec::new();
        for &n in &o.sessions {
            let per = (o.calls / n.max(1)).max(SESSION_CALLS_MIN);
            let mut clients = Vec::new();
            for _ in 0..n {
                clients.push(http_client(&url, None).await?);
            }
            out.push(drive("direct", clients, per).await?);
            let mut clients = Vec::new();
            for _ in 0..n {
                let (ours, theirs) = tokio::io::duplex(1 << 16);
                let stdio = opts.clone();
                tokio::spawn(
                    async move { estop_mcp::serve_io(stdio, tokio::io::split(theirs)).await },
                );
                clients.push(().serve(tokio::io::split(ours)).await?);
            }
            out.push(drive("gateway stdio", clients, per).await?);
            let mut clients = Vec::new();
            for _ in 0..n {
                clients.push(http_client(&front, Some(token.trim())).await?);
            }
            out.push(drive("gateway http", clients, per).await?);
        }
        Ok(out)
    })
}

/// An rmcp client session over streamable HTTP to `url`, with a bearer token if given.
async fn http_client(url: &str, token: Option<&str>) -> anyhow::Result<Client> {
    use rmcp::transport::streamable_http_client::{
        StreamableHttpClientTransport, StreamableHttpClientTransportConfig,
    };
    let mut config = StreamableHttpClientTransportConfig::with_uri(url);
    if let Some(t) = token {
        config = config.auth_header(t);
    }
    Ok(
        ().serve(StreamableHttpClientTransport::from_config(config))
            .await?,
    )
}
