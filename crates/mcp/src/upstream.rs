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
use tokio::process::Command;

type Client = RunningService<RoleClient, Listener>;

/// The first restart waits this long after the previous one, the next twice as long, up to
/// `RESTART_DELAY_MS_MAX`; an incarnation that lived `RESTART_CALM_MS` starts the count over.
const RESTART_DELAY_MS_MIN: u64 = 250;
const RESTART_DELAY_MS_MAX: u64 = 30_000;
const RESTART_CALM_MS: u64 = 60_000;

/// How a `sandbox = true` upstream is started: `estop run` (this binary unless given) on the
/// gateway's daemon, as the run `RUN/NAME` (a child of the gateway's `--run RUN`, so a cancel of
/// it fences the sandbox) or, without `--run`, a fresh `mcp-…-NAME` of its own.
#[derive(Debug, Clone)]
pub struct Launch {
    pub estop: std::path::PathBuf,
    pub data: std::path::PathBuf,
    pub socket: Option<String>,
    /// The gateway's own `--token`, handed to `estop run` in its environment (never on its
    /// command line, which other users can read); `estop run` keeps it from the command.
    pub token: Option<String>,
    /// The gateway's `--run`.
    pub run: Option<String>,
    /// A fresh `mcp-…` for this gateway process, for sandboxes when there is no `--run`.
    pub base: String,
    /// Appended to each sandbox's run name: empty for `estop mcp`; the harness's `-STAMP` (its
    /// process's start), so a resumed trajectory's servers do not reuse the runs a previous
    /// process's ended (`estop run` cancels its run when the command exits).
    pub tag: String,
    /// The environment a stdio upstream's process (or its `estop run`) starts from, in place of
    /// this process's: `None` inherits it (`estop mcp`); the harness gives its allow-list
    /// (`estop_harness::env`). The server's `env` and the token are set over it.
    pub env: Option<Vec<(std::ffi::OsString, std::ffi::OsString)>>,
}

impl Launch {
    /// The run (and parent) of a sandboxed upstream's `incarnation`-th start: `estop run`
    /// cancels its run when the command exits, so a restart needs a run of its own.
    fn run_of(&self, name: &str, incarnation: u32) -> (String, Option<String>) {
        let again = if incarnation > 1 {
            format!("{}-{incarnation}", self.tag)
        } else {
            self.tag.clone()
        };
        match &self.run {
            Some(r) => (format!("{r}/{name}{again}"), Some(r.clone())),
            None => (format!("{}-{name}{again}", self.base), None),
        }
    }

    /// The process that serves `server` over stdio: its `command`, or with `sandbox = true`
    /// `estop run … -- command args…`, which passes stdin and stdout through unchanged.
    pub fn command(&self, server: &Server, command: &str, incarnation: u32) -> Command {
        if !server.sandbox {
            let mut cmd = Command::new(command);
            self.base_env(&mut cmd);
            cmd.args(&server.args).envs(&server.env);
            return cmd;
        }
        let mut cmd = Command::new(&self.estop);
        self.base_env(&mut cmd);
        cmd.arg("run").arg("--data").arg(&self.data);
        if let Some(s) = &self.socket {
            cmd.arg("--socket").arg(s);
        }
        if let Some(p) = &server.sandbox_policy {
            cmd.arg("--policy").arg(p);
        }
        let (run, parent) = self.run_of(&server.name, incarnation);
        cmd.arg("--run").arg(run);
        if let Some(p) = parent {
            cmd.arg("--parent").arg(p);
        }
        cmd.arg("--")
            .arg(command)
            .args(&server.args)
            .envs(&server.env);
        if let Some(t) = &self.token {
            cmd.env("ESTOP_TOKEN", t);
        }
        cmd
    }
}

impl Launch {
    /// Starts `cmd` from [`Launch::env`] when one is given.
    fn base_env(&self, cmd: &mut Command) {
        if let Some(env) = &self.env {
            cmd.env_clear();
            cmd.envs(env.iter().map(|(k, v)| (k, v)));
        }
    }
}

#[derive(Debug)]
pub struct Upstream {
    pub name: String,
    pub trusted: bool,
    server: Server,
    launch: Arc<Launch>,
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
    /// Starts so far (the first is 1).
    incarnation: u32,
}

/// What an upstream says changed, passed on to the gateway (docs/MCP.md).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Change {
    /// `notifications/tools/list_changed`: the gateway lists (and pins) again.
    Tools,
    /// `notifications/resources/list_changed`.
    Resources,
    /// `notifications/prompts/list_changed`.
    Prompts,
    /// `notifications/resources/updated` for this URI (for the clients subscribed to it).
    Updated(String),
}

/// The gateway's client side of one upstream: it passes on what the upstream says changed
/// (with the upstream's index) to the gateway.
#[derive(Debug, Clone)]
pub struct Listener {
    index: usize,
    changed: tokio::sync::mpsc::UnboundedSender<(usize, Change)>,
}

impl Listener {
    pub fn new(
        index: usize,
        changed: tokio::sync::mpsc::UnboundedSender<(usize, Change)>,
    ) -> Listener {
        Listener { index, changed }
    }

    fn tell(&self, change: Change) {
        // The gateway gone, nobody is left to tell: nothing to do.
        let _ = self.changed.send((self.index, change));
    }
}

impl ClientHandler for Listener {
    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.tell(Change::Tools);
    }

    async fn on_resource_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.tell(Change::Resources);
    }

    async fn on_prompt_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.tell(Change::Prompts);
    }

    async fn on_resource_updated(
        &self,
        params: rmcp::model::ResourceUpdatedNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) {
        self.tell(Change::Updated(params.uri));
    }
}

impl Upstream {
    /// Starts the server's command, or connects to its URL, and completes MCP's initialization
    /// with it.
    pub async fn start(
        server: &Server,
        launch: Arc<Launch>,
        listener: Listener,
    ) -> Result<Upstream> {
        let client = connect(server, &launch, 1, listener.clone()).await?;
        Ok(Upstream {
            name: server.name.clone(),
            trusted: server.trusted,
            server: server.clone(),
            launch,
            listener,
            client: std::sync::Mutex::new(Arc::new(client)),
            restarts: tokio::sync::Mutex::new(Backoff {
                since: Instant::now(),
                delay_ms: 0,
                incarnation: 1,
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
        backoff.incarnation += 1;
        let incarnation = backoff.incarnation;
        match connect(
            &self.server,
            &self.launch,
            incarnation,
            self.listener.clone(),
        )
        .await
        {
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
async fn connect(
    server: &Server,
    launch: &Launch,
    incarnation: u32,
    listener: Listener,
) -> Result<Client> {
    let client = match server.transport().map_err(anyhow::Error::msg)? {
        Transport::Command(command) => {
            let cmd = launch.command(server, command, incarnation);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn args(cmd: &Command) -> Vec<String> {
        cmd.as_std()
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    /// `sandbox = true` is the documented recipe spelled by the gateway: `estop run` on the
    /// gateway's daemon, a child run of the gateway's `--run`, the upstream after `--`, its env
    /// kept, the token only in the environment; a restart gets a run of its own.
    #[test]
    fn a_sandboxed_upstream_is_started_by_estop_run_as_a_child_of_the_gateways_run() {
        let text = "[[server]]\nname = \"files\"\ncommand = \"npx\"\nargs = [\"srv\", \"/s\"]\n\
                    env = { A = \"1\" }\nsandbox = true\nsandbox_policy = \"e.toml\"\n";
        let config = crate::config::Config::parse(text).unwrap();
        let server = &config.servers[0];
        let mut launch = Launch {
            estop: "/bin/estop".into(),
            data: "/d".into(),
            socket: Some("/d/s.sock".into()),
            token: Some("estop_ag_secret".into()),
            run: Some("gw".into()),
            base: "mcp-1".into(),
            tag: String::new(),
            env: None,
        };
        let cmd = launch.command(server, "npx", 1);
        assert_eq!(cmd.as_std().get_program(), "/bin/estop");
        assert_eq!(
            args(&cmd),
            [
                "run",
                "--data",
                "/d",
                "--socket",
                "/d/s.sock",
                "--policy",
                "e.toml",
                "--run",
                "gw/files",
                "--parent",
                "gw",
                "--",
                "npx",
                "srv",
                "/s"
            ]
        );
        let envs: Vec<_> = cmd.as_std().get_envs().collect();
        assert!(envs.contains(&("A".as_ref(), Some("1".as_ref()))));
        assert!(envs.contains(&("ESTOP_TOKEN".as_ref(), Some("estop_ag_secret".as_ref()))));
        assert!(!args(&cmd).iter().any(|a| a.contains("secret")));
        assert!(args(&launch.command(server, "npx", 2)).contains(&"gw/files-2".to_string()));
        launch.tag = "-7".into();
        assert!(args(&launch.command(server, "npx", 1)).contains(&"gw/files-7".to_string()));
        assert!(args(&launch.command(server, "npx", 2)).contains(&"gw/files-7-2".to_string()));
        launch.tag = String::new();
        launch.run = None;
        let alone = args(&launch.command(server, "npx", 1));
        assert!(alone.contains(&"mcp-1-files".to_string()), "{alone:?}");
        assert!(!alone.contains(&"--parent".to_string()), "{alone:?}");
        let mut plain = server.clone();
        plain.sandbox = false;
        plain.sandbox_policy = None;
        let cmd = launch.command(&plain, "npx", 1);
        assert_eq!(cmd.as_std().get_program(), "npx");
        assert_eq!(args(&cmd), ["srv", "/s"]);
    }

    /// With an environment given (the harness's allow-list), an upstream starts from it and
    /// the server's `env` alone: a variable of this process's environment is not passed.
    #[test]
    fn a_launch_with_an_environment_starts_from_it_alone() {
        let (name, value) = std::env::vars()
            .find(|(k, v)| k != "PATH" && !v.is_empty())
            .expect("the test runs with some environment");
        let text = "[[server]]\nname = \"e\"\ncommand = \"env\"\nenv = { A = \"1\" }\n";
        let config = crate::config::Config::parse(text).unwrap();
        let launch = Launch {
            estop: "/bin/estop".into(),
            data: "/d".into(),
            socket: None,
            token: None,
            run: None,
            base: "mcp-1".into(),
            tag: String::new(),
            env: Some(vec![("PATH".into(), "/usr/bin:/bin".into())]),
        };
        let mut cmd = launch.command(&config.servers[0], "env", 1);
        let out = cmd.as_std_mut().output().unwrap();
        let got = String::from_utf8_lossy(&out.stdout);
        assert!(
            got.contains("A=1") && got.contains("PATH=/usr/bin:/bin"),
            "{got}"
        );
        assert!(
            !got.contains(&format!("{name}={value}")),
            "{name} passed: {got}"
        );
    }
}
