//! The upstream MCP servers: each a child process the gateway speaks to as an `rmcp` client.

use crate::config::Server;
use anyhow::{Context, Result};
use rmcp::service::{RoleClient, RunningService, ServiceExt};
use rmcp::transport::TokioChildProcess;

#[derive(Debug)]
pub struct Upstream {
    pub name: String,
    pub trusted: bool,
    pub client: RunningService<RoleClient, ()>,
}

impl Upstream {
    /// Starts the server's command and completes MCP's initialization with it.
    pub async fn start(server: &Server) -> Result<Upstream> {
        let mut cmd = tokio::process::Command::new(&server.command);
        cmd.args(&server.args).envs(&server.env);
        let transport = TokioChildProcess::new(cmd).with_context(|| {
            format!(
                "cannot start upstream {:?} ({})",
                server.name, server.command
            )
        })?;
        let client = ().serve(transport).await.with_context(|| {
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
