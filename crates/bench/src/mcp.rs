//! `estop bench mcp`: what `estop mcp` adds to a `tools/call`, against calling the same upstream
//! directly in the same run. The upstream is an rmcp server on loopback HTTP in this process
//! (one `echo` tool); the client is rmcp's, one call at a time (closed loop), each call with
//! fresh arguments so every one through the gateway is a new effect: admitted and completed
//! durably by the daemon. The gateway is measured with its stdio front (a byte stream) and its
//! streamable HTTP front.

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
    /// Calls per path (the first few of each are not counted: connection set-up).
    pub calls: usize,
}

/// One path's figures: microseconds per call, and calls per second.
#[derive(Debug, Clone)]
pub struct Path {
    pub name: &'static str,
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

/// Times `calls` sequential `echo` calls on `client` (the first tenth not counted).
async fn drive(
    name: &'static str,
    client: &rmcp::service::RunningService<rmcp::RoleClient, ()>,
    calls: usize,
) -> anyhow::Result<Path> {
    let warm = (calls / 10).max(1);
    let mut us = Vec::with_capacity(calls);
    let started = Instant::now();
    for i in 0..warm + calls {
        if i == warm {
            us.clear();
        }
        let mut p = CallToolRequestParams::new("echo");
        if name != "direct" {
            p = CallToolRequestParams::new("b__echo");
        }
        let serde_json::Value::Object(args) = serde_json::json!({"text": format!("{name}-{i}")})
        else {
            unreachable!("an object literal")
        };
        p.arguments = Some(args);
        let t = Instant::now();
        let r = client.peer().call_tool(p).await?;
        us.push(u32::try_from(t.elapsed().as_micros()).unwrap_or(u32::MAX));
        anyhow::ensure!(r.is_error != Some(true), "{name}: the call failed: {r:?}");
    }
    let total = started.elapsed().as_secs_f64();
    us.sort_unstable();
    Ok(Path {
        name,
        calls,
        p50_us: percentile(&us, 0.50),
        p99_us: percentile(&us, 0.99),
        calls_per_s: (warm + calls) as f64 / total,
    })
}

/// Direct, through the gateway's stdio front, through its HTTP front: in that order, one run.
pub fn gateway_overhead(o: &McpOptions) -> anyhow::Result<Vec<Path>> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let _ = rustls::crypto::ring::default_provider().install_default();
        use rmcp::transport::streamable_http_client::{
            StreamableHttpClientTransport, StreamableHttpClientTransportConfig,
        };
        let url = serve_upstream().await?;
        let config = o.data.join("bench-mcp.toml");
        std::fs::write(
            &config,
            format!("[[server]]\nname = \"b\"\nurl = {url:?}\n"),
        )?;
        let opts = estop_mcp::Options {
            config,
            data: o.data.clone(),
            socket: Some(o.socket.clone()),
            token: None,
            run: None,
            parent: None,
        };
        let mut out = Vec::new();
        let direct = ().serve(StreamableHttpClientTransport::from_config(
            StreamableHttpClientTransportConfig::with_uri(url.as_str()),
        ));
        out.push(drive("direct", &direct.await?, o.calls).await?);

        let (ours, theirs) = tokio::io::duplex(1 << 16);
        let stdio = opts.clone();
        tokio::spawn(async move { estop_mcp::serve_io(stdio, tokio::io::split(theirs)).await });
        let client = ().serve(tokio::io::split(ours)).await?;
        out.push(drive("gateway stdio", &client, o.calls).await?);

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let front = format!("http://{}/mcp", listener.local_addr()?);
        tokio::spawn(async move { estop_mcp::serve_http_on(opts, listener).await });
        let token = std::fs::read_to_string(o.data.join("agent.token"))?;
        let config =
            StreamableHttpClientTransportConfig::with_uri(front.as_str()).auth_header(token.trim());
        let client = ().serve(StreamableHttpClientTransport::from_config(config)).await?;
        out.push(drive("gateway http", &client, o.calls).await?);
        Ok(out)
    })
}
