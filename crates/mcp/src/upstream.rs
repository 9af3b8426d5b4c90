//! The upstream MCP servers: each a child process (stdio) or a streamable HTTP server the
//! gateway speaks to as an `rmcp` client. One that dies (or whose HTTP session goes away) is
//! started (or connected) again when next needed, no sooner than its backoff allows.

use crate::config::{Server, Transport};
use anyhow::{Context, Result};
use rmcp::ClientHandler;
use rmcp::Peer;
use rmcp::service::{NotificationContext, RoleClient, RunningService, ServiceExt};
use rmcp::transport::TokioChildProcess;
use rmcp::transport::streamable_http_client::{
    StreamableHttpClientTransport, StreamableHttpClientTransportConfig,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

type Client = RunningService<RoleClient, Listener>;

/// The first restart waits this long after the previous one, the next twice as long, up to
/// `RESTART_DELAY_MS_MAX`; an incarnation that lived `RESTART_CALM_MS` starts the count over.
const RESTART_DELAY_MS_MIN: u64 = 250;
const RESTART_DELAY_MS_MAX: u64 = 30_000;
const RESTART_CALM_MS: u64 = 60_000;

#[derive(Debug)]
pub struct Upstream {
    pub name: String,
    pub trusted: bool,
    server: Server,
    listener: Listener,
    client: std::sync::Mutex<Arc<Client>>,
    /// Held while restarting (one restart at a time), with when the next one may happen.
    restarts: tokio::sync::Mutex<Backoff>,
}

#[derive(Debug)]
struct Backoff {
    /// When the current incarnation started.
    since: Instant,
    /// How long after `since` a restart may happen.
    delay_ms: u64,
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
        let client = connect(server, listener.clone()).await?;
        Ok(Upstream {
            name: server.name.clone(),
            trusted: server.trusted,
            server: server.clone(),
            listener,
            client: std::sync::Mutex::new(Arc::new(client)),
            restarts: tokio::sync::Mutex::new(Backoff {
                since: Instant::now(),
                delay_ms: 0,
            }),
        })
    }

    fn current(&self) -> Arc<Client> {
        self.client.lock().expect("not poisoned").clone()
    }

    /// What the upstream said about itself at initialization.
    pub fn info(&self) -> Option<Arc<rmcp::model::ServerPeerInfo>> {
        self.current().peer_info()
    }

    /// A peer to speak to the upstream: the running one, or — if it died — a new one, once
    /// the backoff allows (else an error saying when). Calls that were in flight on the dead
    /// one are not replayed: they end as they ended (the gateway records them `unknown`).
    pub async fn peer(&self) -> Result<Peer<RoleClient>, String> {
        let live = |c: &Arc<Client>| !c.is_closed() && !c.peer().is_transport_closed();
        let client = self.current();
        if live(&client) {
            return Ok(client.peer().clone());
        }
        let mut backoff = self.restarts.lock().await;
        let client = self.current();
        if live(&client) {
            return Ok(client.peer().clone()); // another caller restarted it meanwhile
        }
        let lived = backoff.since.elapsed();
        if lived >= Duration::from_millis(RESTART_CALM_MS) {
            backoff.delay_ms = 0;
        }
        let wait = Duration::from_millis(backoff.delay_ms).saturating_sub(lived);
        if !wait.is_zero() {
            return Err(format!(
                "upstream {:?} is down; it is started again in {} ms",
                self.name,
                wait.as_millis()
            ));
        }
        backoff.since = Instant::now();
        backoff.delay_ms = (backoff.delay_ms * 2).clamp(RESTART_DELAY_MS_MIN, RESTART_DELAY_MS_MAX);
        match connect(&self.server, self.listener.clone()).await {
            Ok(fresh) => {
                let peer = fresh.peer().clone();
                *self.client.lock().expect("not poisoned") = Arc::new(fresh);
                eprintln!("estop mcp: upstream {:?} started again", self.name);
                Ok(peer)
            }
            Err(e) => Err(format!(
                "upstream {:?} is down and did not start again: {e:#}",
                self.name
            )),
        }
    }
}

/// Starts (or connects to) `server` and completes MCP's initialization with it.
async fn connect(server: &Server, listener: Listener) -> Result<Client> {
    let client = match server.transport().map_err(anyhow::Error::msg)? {
        Transport::Command(command) => {
            let mut cmd = tokio::process::Command::new(command);
            cmd.args(&server.args).envs(&server.env);
            let transport = TokioChildProcess::new(cmd)
                .with_context(|| format!("cannot start upstream {:?} ({command})", server.name))?;
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
    };
    client.with_context(|| {
        format!(
            "upstream {:?} did not complete MCP initialization",
            server.name
        )
    })
}
