//! The upstream MCP servers: each a child process (stdio) or a streamable HTTP server the
//! gateway speaks to as an `rmcp` client.

use crate::config::{Server, Transport};
use anyhow::{Context, Result};
use rmcp::ClientHandler;
use rmcp::service::{NotificationContext, RoleClient, RunningService, ServiceExt};
use rmcp::transport::TokioChildProcess;
use rmcp::transport::streamable_http_client::{
    StreamableHttpClientTransport, StreamableHttpClientTransportConfig,
};

#[derive(Debug)]
pub struct Upstream {
    pub name: String,
    pub trusted: bool,
    pub client: RunningService<RoleClient, Listener>,
}

/// The gateway's client side of one upstream: it passes on the upstream's
/// `notifications/tools/list_changed` (with the upstream's index) to the gateway.
#[derive(Debug, Clone)]
pub struct Listener {
    index: usize,
    changed: tokio::sync::mpsc::UnboundedSender<usize>,
}

impl Listener {
    pub fn new(index: usize, changed: tokio::sync::mpsc::UnboundedSender<usize>) -> Listener {
        Listener { index, changed }
    }
}

impl ClientHandler for Listener {
    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        // The gateway gone, nobody is left to tell: nothing to do.
        let _ = self.changed.send(self.index);
    }
}

impl Upstream {
    /// Starts the server's command, or connects to its URL, and completes MCP's initialization
    /// with it.
    pub async fn start(server: &Server, listener: Listener) -> Result<Upstream> {
        let client = match server.transport().map_err(anyhow::Error::msg)? {
            Transport::Command(command) => {
                let mut cmd = tokio::process::Command::new(command);
                cmd.args(&server.args).envs(&server.env);
                let transport = TokioChildProcess::new(cmd).with_context(|| {
                    format!("cannot start upstream {:?} ({command})", server.name)
                })?;
                listener.serve(transport).await
            }
            Transport::Http { url, headers } => {
                // reqwest's TLS without a provider of its own: the same ring as the rest of estop.
                let _ = rustls::crypto::ring::default_provider().install_default();
                let config = StreamableHttpClientTransportConfig::with_uri(url)
                    .custom_headers(headers.into_iter().collect());
                listener
                    .serve(StreamableHttpClientTransport::from_config(config))
                    .await
            }
        }
        .with_context(|| {
            format!(
                "upstream {:?} did not complete MCP initialization",
                server.name
            )
        })?;
        Ok(Upstream {
            name: server.name.clone(),
            trusted: server.trusted,
            client,
        })
    }
}
