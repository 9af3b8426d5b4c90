//! The gateway's configuration file: the upstream MCP servers it fronts and how long a held call
//! waits. What a call may do is the gate's policy, never this file.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;

/// The separator between a server's name and its tool's name in the tools the gateway lists:
/// `files__write`. MCP tool names allow `[A-Za-z0-9_.-]`, so it survives every client.
pub const SEPARATOR: &str = "__";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub gateway: Gateway,
    #[serde(rename = "server", default)]
    pub servers: Vec<Server>,
    #[serde(default)]
    pub runs: Runs,
    #[serde(default)]
    pub http: Http,
}

/// Which run a call belongs to, beyond the session's own (docs/MCP.md, "Runs").
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Runs {
    /// An HTTP request header whose value names the run (e.g. `Estop-Run`), set by the client's
    /// config or a proxy in front; absent: the session's run.
    #[serde(default)]
    pub header: Option<String>,
    /// Whether a call's `_meta["io.estop/run"]` may name its run.
    #[serde(default)]
    pub meta: bool,
}

/// The streamable HTTP front (`estop mcp --listen ADDR`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Http {
    /// `Host` values served (DNS rebinding defence): loopback names unless listed.
    #[serde(default = "allowed_hosts_default")]
    pub allowed_hosts: Vec<String>,
    /// Browser origins that may call (`scheme://host:port`, `:*` for any port); a request with
    /// any other `Origin` is refused, and with none listed every request with an `Origin` is.
    #[serde(default)]
    pub allowed_origins: Vec<String>,
    /// Whether `--listen` may take an address other than loopback.
    #[serde(default)]
    pub allow_remote: bool,
    #[serde(default = "sessions_max_default")]
    pub sessions_max: usize,
    #[serde(default = "body_bytes_max_default")]
    pub body_bytes_max: usize,
    /// A session nobody used for this long is closed.
    #[serde(default = "session_idle_ms_default")]
    pub session_idle_ms: u64,
    /// Distinct agent tokens (principals) served at once.
    #[serde(default = "principals_max_default")]
    pub principals_max: usize,
}

fn allowed_hosts_default() -> Vec<String> {
    ["localhost", "127.0.0.1", "::1"].map(String::from).to_vec()
}
fn sessions_max_default() -> usize {
    64
}
fn body_bytes_max_default() -> usize {
    1 << 20
}
fn session_idle_ms_default() -> u64 {
    30 * 60 * 1000
}
fn principals_max_default() -> usize {
    64
}

impl Default for Http {
    fn default() -> Self {
        Http {
            allowed_hosts: allowed_hosts_default(),
            allowed_origins: Vec::new(),
            allow_remote: false,
            sessions_max: sessions_max_default(),
            body_bytes_max: body_bytes_max_default(),
            session_idle_ms: session_idle_ms_default(),
            principals_max: principals_max_default(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gateway {
    /// How long a held call waits for an operator before the model is told it is held.
    #[serde(default = "hold_ms_default")]
    pub hold_ms: u64,
    /// Most tasks running at once (held calls carried by tasks, both forms).
    #[serde(default = "tasks_running_max_default")]
    pub tasks_running_max: usize,
    /// Most tasks kept at once, running or ended (an ended task is kept its TTL), both forms.
    #[serde(default = "tasks_kept_max_default")]
    pub tasks_kept_max: usize,
    /// Most tasks one principal keeps at once (running or ended, both forms): its share.
    #[serde(default = "tasks_per_principal_max_default")]
    pub tasks_per_principal_max: usize,
    /// How long a task lives (and an ended one is kept); a 2025-11-25 client may ask less.
    #[serde(default = "task_ttl_ms_default")]
    pub task_ttl_ms: u64,
    /// The gate's longest request line (`estop serve --line-bytes-max`; `hello` does not say
    /// it). A call whose `admit` would be longer is refused by the gateway before it is sent.
    #[serde(default = "line_bytes_max_default")]
    pub line_bytes_max: usize,
}

fn hold_ms_default() -> u64 {
    30_000
}
fn tasks_running_max_default() -> usize {
    256
}
fn tasks_kept_max_default() -> usize {
    4096
}
fn tasks_per_principal_max_default() -> usize {
    64
}
fn task_ttl_ms_default() -> u64 {
    24 * 60 * 60 * 1000
}
fn line_bytes_max_default() -> usize {
    estop_protocol::limits::LINE_BYTES_MAX_DEFAULT
}

/// The most tasks `tasks_kept_max` may keep (each holds its call's whole result).
pub const TASKS_KEPT_MAX: usize = 1 << 16;
/// The shortest `task_ttl_ms`: a task must outlive a poll or two.
pub const TASK_TTL_MS_MIN: u64 = 1000;
/// The longest `task_ttl_ms`: a week.
pub const TASK_TTL_MS_MAX: u64 = 7 * 24 * 60 * 60 * 1000;

impl Default for Gateway {
    fn default() -> Self {
        Gateway {
            hold_ms: hold_ms_default(),
            tasks_running_max: tasks_running_max_default(),
            tasks_kept_max: tasks_kept_max_default(),
            tasks_per_principal_max: tasks_per_principal_max_default(),
            task_ttl_ms: task_ttl_ms_default(),
            line_bytes_max: line_bytes_max_default(),
        }
    }
}

impl Gateway {
    /// The tasks' bounds make sense: at least one task each, a principal's share within the
    /// running bound, the running bound within the kept one, nothing beyond what memory takes.
    fn check(&self) -> Result<(), ConfigError> {
        let (share, running, kept) = (
            self.tasks_per_principal_max,
            self.tasks_running_max,
            self.tasks_kept_max,
        );
        let bad = |why: String| Err(ConfigError::Bad(format!("[gateway] {why}")));
        if share == 0 || running == 0 || kept == 0 {
            return bad(
                "tasks_per_principal_max, tasks_running_max and tasks_kept_max must be at least 1"
                    .into(),
            );
        }
        if !(share <= running && running <= kept && kept <= TASKS_KEPT_MAX) {
            return bad(format!(
                "the tasks' bounds must read tasks_per_principal_max ({share}) <= \
                 tasks_running_max ({running}) <= tasks_kept_max ({kept}) <= {TASKS_KEPT_MAX}"
            ));
        }
        if !(TASK_TTL_MS_MIN..=TASK_TTL_MS_MAX).contains(&self.task_ttl_ms) {
            return bad(format!(
                "task_ttl_ms {} is outside {TASK_TTL_MS_MIN}..={TASK_TTL_MS_MAX} (1 s to a week)",
                self.task_ttl_ms
            ));
        }
        Ok(())
    }
}

/// One upstream MCP server: a child process speaking MCP over stdio (`command`), or a server
/// reached over streamable HTTP (`url`, with `headers` sent on every request, e.g. its
/// `Authorization`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Server {
    pub name: String,
    #[serde(default)]
    pub command: Option<String>,
    #[serde(default)]
    pub url: Option<String>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Whether its tool annotations may seed class and reversibility (untrusted: worst case).
    #[serde(default)]
    pub trusted: bool,
    /// Run `command` inside `estop run`'s sandbox, as a run of its own (docs/MCP.md).
    #[serde(default)]
    pub sandbox: bool,
    /// The sandbox's settings file (`estop run --policy`, table `[egress]`); only with
    /// `sandbox = true`.
    #[serde(default)]
    pub sandbox_policy: Option<std::path::PathBuf>,
}

/// A configuration that cannot be used, with what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    // The cause is in the message, not a `source`, so that `{:#}` does not print it twice.
    #[error("cannot read {path}: {err}")]
    Read { path: String, err: std::io::Error },
    #[error("{path}: {err}")]
    Parse { path: String, err: toml::de::Error },
    #[error("server name {0:?}: use 1-32 of [A-Za-z0-9-] (it prefixes tool names, before `__`)")]
    BadName(String),
    #[error("server {0:?} is declared twice")]
    Duplicate(String),
    #[error("no [[server]] declared: the gateway would front nothing")]
    Empty,
    #[error("server {name:?}: {why}")]
    Transport { name: String, why: String },
    #[error("{0}")]
    Bad(String),
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|err| ConfigError::Read {
            path: path.display().to_string(),
            err,
        })?;
        Config::parse(&text).map_err(|e| match e {
            ConfigError::Parse { err, .. } => ConfigError::Parse {
                path: path.display().to_string(),
                err,
            },
            e => e,
        })
    }

    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|err| ConfigError::Parse {
            path: String::new(),
            err,
        })?;
        if config.servers.is_empty() {
            return Err(ConfigError::Empty);
        }
        check_servers(&config.servers)?;
        config.gateway.check()?;
        config.check_front()?;
        Ok(config)
    }

    /// The `[runs]` and `[http]` tables make sense.
    fn check_front(&self) -> Result<(), ConfigError> {
        if let Some(h) = &self.runs.header
            && http::HeaderName::from_bytes(h.as_bytes()).is_err()
        {
            return Err(ConfigError::Bad(format!(
                "[runs] header {h:?} is not a valid HTTP header name"
            )));
        }
        let h = &self.http;
        if h.sessions_max == 0 || h.body_bytes_max < 1024 || h.principals_max == 0 {
            return Err(ConfigError::Bad(
                "[http] sessions_max and principals_max must be at least 1, body_bytes_max 1024"
                    .into(),
            ));
        }
        if h.allowed_hosts.is_empty() {
            return Err(ConfigError::Bad(
                "[http] allowed_hosts is empty: list the Host names clients use".into(),
            ));
        }
        Ok(())
    }
}

/// The `[[server]]` tables make sense: names of 1-32 `[A-Za-z0-9-]` (they prefix tool names,
/// before `__`), none twice, each with one transport. Also what `estop agent`'s config checks of
/// its own `[[server]]` tables (crates/harness).
pub fn check_servers(servers: &[Server]) -> Result<(), ConfigError> {
    let mut seen = std::collections::BTreeSet::new();
    for s in servers {
        // No `_` in a server name: `a__b` + `c` and `a` + `b__c` must not both read `a__b__c`.
        let ok = (1..=32).contains(&s.name.len())
            && s.name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-');
        if !ok {
            return Err(ConfigError::BadName(s.name.clone()));
        }
        if !seen.insert(s.name.as_str()) {
            return Err(ConfigError::Duplicate(s.name.clone()));
        }
        s.transport().map_err(|why| ConfigError::Transport {
            name: s.name.clone(),
            why,
        })?;
    }
    Ok(())
}

/// How the gateway reaches one upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport<'a> {
    Command(&'a str),
    Http {
        url: &'a str,
        headers: Vec<(http::HeaderName, http::HeaderValue)>,
    },
}

impl Server {
    /// The server's transport: exactly one of `command` and `url`; `headers` only with `url`,
    /// each a valid HTTP header.
    pub fn transport(&self) -> Result<Transport<'_>, String> {
        if self.sandbox_policy.is_some() && !self.sandbox {
            return Err("sandbox_policy goes with sandbox = true".into());
        }
        if self.sandbox && self.url.is_some() {
            return Err(
                "sandbox = true runs a command in the sandbox; a url server is not started \
                 by the gateway"
                    .into(),
            );
        }
        match (&self.command, &self.url) {
            (Some(c), None) if self.headers.is_empty() => Ok(Transport::Command(c)),
            (Some(_), None) => Err("headers go with url, not command".into()),
            (None, Some(url)) => {
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    return Err(format!("url {url:?}: use an http:// or https:// URL"));
                }
                let headers = self
                    .headers
                    .iter()
                    .map(|(k, v)| {
                        let name = http::HeaderName::from_bytes(k.as_bytes()).map_err(|_| {
                            format!("header name {k:?} is not a valid HTTP header name")
                        })?;
                        // The value is the operator's (often a credential): never echoed.
                        let value = http::HeaderValue::from_str(v).map_err(|_| {
                            format!("header {k:?}: its value is not a valid HTTP header value")
                        })?;
                        Ok((name, value))
                    })
                    .collect::<Result<_, String>>()?;
                Ok(Transport::Http { url, headers })
            }
            (Some(_), Some(_)) => Err("give command or url, not both".into()),
            (None, None) => Err("give command (a stdio server) or url (streamable HTTP)".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_is_a_command_or_a_url_and_headers_go_with_the_url() {
        let http = "[[server]]\nname = \"remote\"\nurl = \"https://mcp.example/mcp\"\nheaders = { Authorization = \"Bearer s3cret\" }\n";
        let c = Config::parse(http).unwrap();
        match c.servers[0].transport().unwrap() {
            Transport::Http { url, headers } => {
                assert_eq!(url, "https://mcp.example/mcp");
                assert_eq!(headers[0].0, "authorization");
            }
            other => panic!("{other:?}"),
        }
        for (bad, says) in [
            ("url = \"ftp://x\"", "http:// or https://"),
            ("command = \"x\"\nurl = \"http://x\"", "not both"),
            ("args = []", "command (a stdio server) or url"),
            (
                "command = \"x\"\nheaders = { A = \"b\" }",
                "headers go with url",
            ),
            (
                "url = \"http://x\"\nheaders = { \"bad name\" = \"b\" }",
                "not a valid HTTP header name",
            ),
            (
                "url = \"http://x\"\nheaders = { A = \"s3cret\\n\" }",
                "value is not a valid",
            ),
            (
                "url = \"http://x\"\nsandbox = true",
                "a url server is not started",
            ),
            (
                "command = \"x\"\nsandbox_policy = \"e.toml\"",
                "goes with sandbox = true",
            ),
        ] {
            let text = format!("[[server]]\nname = \"r\"\n{bad}\n");
            let e = Config::parse(&text).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
            assert!(!e.contains("s3cret"), "a header value is never echoed: {e}");
        }
    }

    #[test]
    fn bad_configs_are_refused_with_the_reason() {
        let one = "[[server]]\nname = \"files\"\ncommand = \"x\"\n";
        let c = Config::parse(one).unwrap();
        assert_eq!(c.gateway.hold_ms, 30_000);
        let g = &c.gateway;
        assert_eq!(
            (
                g.tasks_running_max,
                g.tasks_kept_max,
                g.tasks_per_principal_max
            ),
            (256, 4096, 64)
        );
        assert_eq!(g.task_ttl_ms, 24 * 60 * 60 * 1000);
        assert!(!c.servers[0].trusted);
        assert!(matches!(Config::parse(""), Err(ConfigError::Empty)));
        let under = "[[server]]\nname = \"a__b\"\ncommand = \"x\"\n";
        assert!(matches!(Config::parse(under), Err(ConfigError::BadName(_))));
        let twice = format!("{one}{one}");
        assert!(matches!(
            Config::parse(&twice),
            Err(ConfigError::Duplicate(_))
        ));
        let unknown = "[[server]]\nname = \"a\"\ncommand = \"x\"\ntrusty = true\n";
        assert!(matches!(
            Config::parse(unknown),
            Err(ConfigError::Parse { .. })
        ));
    }

    #[test]
    fn zero_or_absurd_task_bounds_are_refused_at_load() {
        let server = "[[server]]\nname = \"files\"\ncommand = \"x\"\n";
        let ok = "tasks_running_max = 3\ntasks_kept_max = 4\ntasks_per_principal_max = 2\n\
                  task_ttl_ms = 1000";
        let c = Config::parse(&format!("[gateway]\n{ok}\n{server}")).unwrap();
        assert_eq!(c.gateway.tasks_per_principal_max, 2);
        for (bad, says) in [
            ("tasks_running_max = 0", "at least 1"),
            ("tasks_kept_max = 0", "at least 1"),
            ("tasks_per_principal_max = 0", "at least 1"),
            (
                "tasks_per_principal_max = 300",
                "tasks_per_principal_max (300) <=",
            ),
            (
                "tasks_running_max = 5000",
                "tasks_running_max (5000) <= tasks_kept_max",
            ),
            (
                "tasks_kept_max = 100000\ntasks_running_max = 100000",
                "<= 65536",
            ),
            ("task_ttl_ms = 0", "task_ttl_ms 0 is outside"),
            ("task_ttl_ms = 999999999999", "is outside"),
            ("tasks_running_max = -1", "tasks_running_max"),
        ] {
            let e = Config::parse(&format!("[gateway]\n{bad}\n{server}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
