//! `estop agent`'s configuration file (TOML): models with their prices and rate limits, the
//! budget, and the tools. Parsed whole at start; anything wrong is an error naming the field.

use crate::budget::{Limits, Prices};
use crate::runner::Tool;
use estop_mcp::config::SEPARATOR;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub harness: HarnessSection,
    #[serde(rename = "model", default)]
    pub models: Vec<ModelSection>,
    #[serde(default)]
    pub budget: BudgetSection,
    #[serde(rename = "tool", default)]
    pub tools: Vec<ToolSection>,
    /// MCP servers whose tools are offered as `server__tool` (the shape of `estop mcp`'s
    /// `[[server]]`; crate::mcp).
    #[serde(rename = "server", default)]
    pub servers: Vec<estop_mcp::config::Server>,
    /// When the journal compacts and which ended trajectories it keeps (crate::journal).
    #[serde(default)]
    pub journal: crate::journal::JournalOptions,
    /// The tool with which a trajectory starts sub-agents (crate::subagent); none without it.
    #[serde(default)]
    pub subagents: Option<crate::subagent::Subagents>,
    /// The task contract of the trajectories started under this config (crate::contract);
    /// `estop agent run --contract FILE` gives another.
    #[serde(default, deserialize_with = "crate::contract::strict")]
    pub contract: Option<crate::contract::Contract>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HarnessSection {
    /// The system prompt of every trajectory.
    #[serde(default = "default_system")]
    pub system: String,
    /// How long a cut stream may still be read for its end.
    #[serde(default = "default_grace")]
    pub grace_ms: u64,
    /// Model calls in flight at once.
    #[serde(default = "default_workers")]
    pub workers: usize,
    #[serde(default = "default_tool_deadline")]
    pub tool_deadline_ms: u64,
    /// Where each trajectory's workspace lease is made (`ROOT/ID`); none without it.
    #[serde(default)]
    pub workspaces: Option<std::path::PathBuf>,
}

impl Default for HarnessSection {
    fn default() -> Self {
        HarnessSection {
            system: default_system(),
            grace_ms: default_grace(),
            workers: default_workers(),
            tool_deadline_ms: default_tool_deadline(),
            workspaces: None,
        }
    }
}

fn default_system() -> String {
    "You are an agent. Use the tools to do the task, then answer.".into()
}
fn default_grace() -> u64 {
    500
}
fn default_workers() -> usize {
    4
}
fn default_tool_deadline() -> u64 {
    120_000
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// The name `--model` picks, and the model sent to the provider.
    pub name: String,
    /// The provider's OpenAI-compatible base URL (`https://api.openai.com/v1`).
    pub base_url: String,
    /// The environment variable holding the API key (never the key itself).
    pub api_key_env: Option<String>,
    pub usd_per_mtok_input: f64,
    pub usd_per_mtok_cached_input: Option<f64>,
    pub usd_per_mtok_output: f64,
    #[serde(default = "default_max_output")]
    pub max_output_tokens: u64,
    #[serde(default = "default_call_deadline")]
    pub call_deadline_ms: u64,
    /// The provider's limits; the harness's bucket is set under them.
    #[serde(default = "default_tpm")]
    pub tpm: u64,
    #[serde(default = "default_rpm")]
    pub rpm: u64,
    /// How a failed call is retried (crate::retry): the first backoff's ceiling, doubling up
    /// to `retry_cap_ms`, with full jitter; `retries_max` failures in a row at most; a
    /// `Retry-After` honoured up to `retry_after_max_ms`.
    #[serde(default = "default_retry_base")]
    pub retry_base_ms: u64,
    #[serde(default = "default_retry_cap")]
    pub retry_cap_ms: u64,
    #[serde(default = "default_retries_max")]
    pub retries_max: u32,
    #[serde(default = "default_retry_after_max")]
    pub retry_after_max_ms: u64,
}

fn default_retry_base() -> u64 {
    crate::retry::DEFAULT.base_ms
}
fn default_retry_cap() -> u64 {
    crate::retry::DEFAULT.cap_ms
}
fn default_retries_max() -> u32 {
    crate::retry::DEFAULT.retries_max
}
fn default_retry_after_max() -> u64 {
    crate::retry::DEFAULT.retry_after_max_ms
}

fn default_max_output() -> u64 {
    1024
}
fn default_call_deadline() -> u64 {
    120_000
}
fn default_tpm() -> u64 {
    200_000
}
fn default_rpm() -> u64 {
    500
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetSection {
    pub turns: Option<u64>,
    pub tokens: Option<u64>,
    pub wall_clock_ms: Option<u64>,
    pub usd: Option<f64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolSection {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// The JSON schema of the arguments (a TOML table).
    #[serde(default = "object_schema")]
    pub parameters: toml::Value,
    /// A sandboxed command: the arguments (JSON) on stdin, the result on stdout.
    #[serde(default)]
    pub command: Vec<String>,
    /// Or an HTTP tool: a request here, through the egress proxy (as the child run
    /// `TRAJECTORY/CALL_ID`: crate::http), the answer's body the result.
    pub url: Option<String>,
    /// An HTTP tool's method: GET, POST (the default), PUT, PATCH or DELETE. POST, PUT and
    /// PATCH send the arguments as the JSON body; GET and DELETE send them as the query.
    #[serde(default)]
    pub method: Option<String>,
    /// An HTTP tool's path after the URL's, `{name}` filled from the argument `name` as one
    /// percent-encoded segment (`"/orders/{order_id}"`).
    #[serde(default)]
    pub path: Option<String>,
    /// An HTTP tool's static headers; no credentials (the egress credential store's), no
    /// hop-by-hop, Host, Content-Length or Proxy-* header.
    #[serde(default)]
    pub headers: std::collections::BTreeMap<String, String>,
    /// An HTTP tool's `[egress]` settings file (`estop run --policy`'s shape): the
    /// destinations it may reach beyond the refused ones, `hold_ms`, the body bounds, and the
    /// `credentials` store injected per host. Only with `url`.
    #[serde(default)]
    pub egress_policy: Option<std::path::PathBuf>,
    /// Run `command` inside `estop run`'s sandbox, as a child run of the trajectory's run.
    #[serde(default)]
    pub sandbox: bool,
    /// The sandbox's settings file (`estop run --policy`, table `[egress]`); only with
    /// `sandbox = true`.
    #[serde(default)]
    pub sandbox_policy: Option<std::path::PathBuf>,
    #[serde(default)]
    pub read_only: bool,
    /// The hosts of the `egress_policy`'s credential store whose handles a trajectory is
    /// leased for this tool (default: all of them). Only with `url`.
    #[serde(default)]
    pub credentials: Option<Vec<String>>,
    /// A command's variables beyond the allow-list (crate::env), set to these values.
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
    /// A command's variables beyond the allow-list, passed on from the runner's environment
    /// (never the provider's key or a credential store's source variable: refused at load).
    #[serde(default)]
    pub env_pass: Vec<String>,
}

impl ToolSection {
    /// The HTTP tool's request settings; an unknown method is an error.
    fn http(&self) -> Result<crate::http::HttpSpec, String> {
        Ok(crate::http::HttpSpec {
            method: match &self.method {
                Some(m) => m.parse()?,
                None => crate::http::Method::default(),
            },
            path: self.path.clone(),
            headers: self.headers.clone(),
        })
    }
}

fn object_schema() -> toml::Value {
    toml::Value::Table(toml::map::Map::from_iter([(
        "type".to_string(),
        toml::Value::String("object".into()),
    )]))
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: String,
        source: Box<toml::de::Error>,
    },
    #[error("{0}")]
    Invalid(String),
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: shown.clone(),
            source,
        })?;
        let c: Config = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: shown,
            source: Box::new(e),
        })?;
        c.check()?;
        Ok(c)
    }

    fn check(&self) -> Result<(), ConfigError> {
        let bad = |s: String| Err(ConfigError::Invalid(s));
        for m in &self.models {
            let prices = [
                m.usd_per_mtok_input,
                m.usd_per_mtok_cached_input.unwrap_or(0.0),
                m.usd_per_mtok_output,
            ];
            if prices.iter().any(|p| !p.is_finite() || *p < 0.0) {
                return bad(format!(
                    "model {:?}: prices must be finite and not negative",
                    m.name
                ));
            }
            if m.retry_base_ms == 0
                || m.retry_base_ms > m.retry_cap_ms
                || m.retries_max > crate::retry::RETRIES_MAX
                || m.retry_cap_ms > crate::model::RETRY_AFTER_MS_MAX
                || m.retry_after_max_ms > crate::model::RETRY_AFTER_MS_MAX
            {
                return bad(format!(
                    "model {:?}: retry_base_ms must be above 0 and at most retry_cap_ms, \
                     retry_cap_ms and retry_after_max_ms at most {} (a day), retries_max at \
                     most {}",
                    m.name,
                    crate::model::RETRY_AFTER_MS_MAX,
                    crate::retry::RETRIES_MAX
                ));
            }
            if m.tpm == 0 || m.rpm == 0 || m.max_output_tokens == 0 {
                return bad(format!(
                    "model {:?}: tpm, rpm and max_output_tokens must be above 0",
                    m.name
                ));
            }
        }
        if self.budget.usd.is_some_and(|u| !u.is_finite() || u < 0.0) {
            return bad("budget.usd must be finite and not negative".into());
        }
        for t in &self.tools {
            if t.command.is_empty() == t.url.is_none() {
                return bad(format!(
                    "tool {:?}: give exactly one of command and url",
                    t.name
                ));
            }
            if t.sandbox && t.command.is_empty() {
                return bad(format!("tool {:?}: sandbox = true runs a command", t.name));
            }
            if t.sandbox_policy.is_some() && !t.sandbox {
                return bad(format!(
                    "tool {:?}: sandbox_policy goes with sandbox = true",
                    t.name
                ));
            }
            if t.egress_policy.is_some() && t.url.is_none() {
                return bad(format!(
                    "tool {:?}: egress_policy goes with url (a sandboxed command's is \
                     sandbox_policy)",
                    t.name
                ));
            }
            if t.credentials.is_some() && t.url.is_none() {
                return bad(format!(
                    "tool {:?}: credentials goes with url (an HTTP tool's credential store)",
                    t.name
                ));
            }
            if t.url.is_some() && !(t.env.is_empty() && t.env_pass.is_empty()) {
                return bad(format!(
                    "tool {:?}: env and env_pass go with command (an HTTP tool starts no \
                     process)",
                    t.name
                ));
            }
            if let Some(url) = &t.url
                && let Err(e) = crate::model::Endpoint::new(url, None)
            {
                return bad(format!("tool {:?}: {e}", t.name));
            }
            let http = t.method.is_some() || t.path.is_some() || !t.headers.is_empty();
            match &t.url {
                None if http => {
                    return bad(format!(
                        "tool {:?}: method, path and headers go with url",
                        t.name
                    ));
                }
                Some(url) => {
                    if let Err(e) = t.http().and_then(|h| h.check(url)) {
                        return bad(format!("tool {:?}: {e}", t.name));
                    }
                }
                None => {}
            }
        }
        estop_mcp::config::check_servers(&self.servers)
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        if let Some(t) = self.tools.iter().find(|t| t.name.contains(SEPARATOR)) {
            return bad(format!(
                "tool {:?}: `{SEPARATOR}` is kept for MCP tools (server{SEPARATOR}tool)",
                t.name
            ));
        }
        if let Some(sub) = &self.subagents {
            sub.check().map_err(ConfigError::Invalid)?;
            if self.tools.iter().any(|t| t.name == sub.tool) {
                return bad(format!(
                    "tool {:?}: the name is [subagents]' tool already",
                    sub.tool
                ));
            }
        }
        if self.harness.workers == 0 {
            return bad("harness.workers must be above 0".into());
        }
        self.journal.check().or_else(bad)?;
        if let Some(c) = &self.contract {
            c.check()
                .map_err(|e| ConfigError::Invalid(format!("contract: {e}")))?;
            if !c.workspace_files.is_empty() && self.harness.workspaces.is_none() {
                return bad(
                    "contract.workspace_files needs [harness] workspaces (the workspace lease)"
                        .into(),
                );
            }
        }
        Ok(())
    }

    pub fn model(&self, name: &str) -> Result<&ModelSection, ConfigError> {
        self.models.iter().find(|m| m.name == name).ok_or_else(|| {
            let known: Vec<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
            ConfigError::Invalid(format!(
                "no [[model]] named {name:?} (the file has {known:?})"
            ))
        })
    }

    /// The tools `names` picks (all of them when empty) from the `[[tool]]`s and the tools the
    /// MCP servers listed (`mcp`, from [`crate::mcp::Upstreams::start`]); an unknown name is an
    /// error.
    pub fn tools(&self, names: &[String], mcp: Vec<Tool>) -> Result<Vec<Tool>, ConfigError> {
        let mut all = self
            .tools
            .iter()
            .map(|t| self.tool(t))
            .collect::<Result<Vec<Tool>, ConfigError>>()?;
        check_env(&self.secrets(&all), &all)?;
        all.extend(
            self.subagents
                .as_ref()
                .map(crate::subagent::Subagents::tool),
        );
        all.extend(mcp);
        if names.is_empty() {
            return Ok(all);
        }
        names
            .iter()
            .map(|n| {
                all.iter().find(|t| &t.name == n).cloned().ok_or_else(|| {
                    ConfigError::Invalid(format!(
                        "no [[tool]] named {n:?}, and no MCP server listed it"
                    ))
                })
            })
            .collect()
    }

    /// One `[[tool]]` with its egress settings and credential store loaded (an HTTP tool's
    /// `egress_policy`; a sandboxed command's `sandbox_policy`, for its store's variables).
    fn tool(&self, t: &ToolSection) -> Result<Tool, ConfigError> {
        let invalid =
            |what: &str, e: String| ConfigError::Invalid(format!("tool {:?}: {what}{e}", t.name));
        let egress = match &t.egress_policy {
            Some(p) => Some(
                crate::http::Egress::load(p)
                    .map_err(|e| invalid("egress_policy: ", format!("{e:#}")))?,
            ),
            None => None,
        };
        // A host the tool may be leased must be one its store has: a typo would otherwise
        // silently send its requests without the credential.
        if let Some(h) = t.credentials.iter().flatten().find(|h| {
            !egress
                .as_ref()
                .is_some_and(|e| e.credentials.entries.iter().any(|c| &c.host == *h))
        }) {
            return Err(invalid(
                "",
                format!(
                    "credentials names {h:?}, which its egress_policy's credential store has \
                     no credential for"
                ),
            ));
        }
        let store_vars = match &t.sandbox_policy {
            Some(p) => crate::env::store_vars(p)
                .map_err(|e| invalid("sandbox_policy: ", format!("{e:#}")))?,
            None => Vec::new(),
        };
        Ok(Tool {
            name: t.name.clone(),
            description: t.description.clone(),
            parameters: serde_json::to_value(&t.parameters).unwrap_or_default(),
            command: t.command.clone(),
            url: t.url.clone(),
            http: t.http().map_err(|e| invalid("", e))?,
            mcp: None,
            sandbox: t.sandbox,
            sandbox_policy: t.sandbox_policy.clone(),
            read_only: t.read_only,
            egress,
            credentials: t.credentials.clone(),
            env: crate::env::ToolEnv {
                set: t.env.clone(),
                pass: t.env_pass.clone(),
            },
            store_vars,
        })
    }

    /// The runner's variables no tool may be given, each with what it is: every model's
    /// provider key and every credential store's source variables.
    fn secrets(&self, tools: &[Tool]) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for m in &self.models {
            if let Some(k) = &m.api_key_env {
                out.insert(
                    k.clone(),
                    format!("the provider key of model {:?} (api_key_env)", m.name),
                );
            }
        }
        for t in tools {
            let http = t.egress.iter().flat_map(|e| e.credentials.env_names.iter());
            for v in http {
                out.insert(
                    v.clone(),
                    format!(
                        "a credential's source in tool {:?}'s egress_policy store",
                        t.name
                    ),
                );
            }
            for v in &t.store_vars {
                out.insert(
                    v.clone(),
                    format!(
                        "a credential's source in tool {:?}'s sandbox_policy store",
                        t.name
                    ),
                );
            }
        }
        out
    }

    pub fn limits(&self) -> Limits {
        Limits {
            turns_max: self.budget.turns,
            tokens_max: self.budget.tokens,
            wall_ms_max: self.budget.wall_clock_ms,
            usd_micros_max: self.budget.usd.map(|u| (u * 1e6).round() as u64),
        }
    }
}

/// No tool is given a secret of the runner's as a variable: a tool's `env_pass` naming one (or
/// estop's own), a tool's `env` setting estop's own, or a secret on the allow-list every tool
/// gets, is refused naming the tool and the variable.
fn check_env(secrets: &BTreeMap<String, String>, tools: &[Tool]) -> Result<(), ConfigError> {
    if let Some((name, what)) = secrets.iter().find(|(n, _)| crate::env::allowed(n)) {
        return Err(ConfigError::Invalid(format!(
            "{name} is {what}, and on the allow-list every tool is given (docs/HARNESS.md): \
             keep the secret in another variable"
        )));
    }
    for t in tools {
        let passed = t
            .env
            .pass
            .iter()
            .filter_map(|n| crate::env::refused(n, secrets));
        let set = t
            .env
            .set
            .keys()
            .filter_map(|n| crate::env::refused(n, &BTreeMap::new()));
        if let Some(why) = passed.chain(set).next() {
            return Err(ConfigError::Invalid(format!(
                "tool {:?}: env: {why}",
                t.name
            )));
        }
    }
    Ok(())
}

impl ModelSection {
    /// The retry policy of its calls.
    pub fn retry(&self) -> crate::retry::Retry {
        crate::retry::Retry {
            base_ms: self.retry_base_ms,
            cap_ms: self.retry_cap_ms,
            retries_max: self.retries_max,
            retry_after_max_ms: self.retry_after_max_ms,
        }
    }

    /// Prices in micro-dollars per token (= dollars per million tokens).
    pub fn prices(&self) -> Prices {
        Prices {
            input: self.usd_per_mtok_input,
            cached_input: self
                .usd_per_mtok_cached_input
                .unwrap_or(self.usd_per_mtok_input),
            output: self.usd_per_mtok_output,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_parses_and_bad_ones_say_why() {
        let ok = r#"
[[model]]
name = "m"
base_url = "http://127.0.0.1:1/v1"
usd_per_mtok_input = 3.0
usd_per_mtok_output = 15.0

[budget]
turns = 5
usd = 0.5

[[tool]]
name = "echo"
command = ["cat"]
read_only = true
parameters = { type = "object", properties = { q = { type = "string" } } }
"#;
        let c: Config = toml::from_str(ok).unwrap();
        c.check().unwrap();
        assert_eq!(c.limits().usd_micros_max, Some(500_000));
        assert_eq!(c.model("m").unwrap().prices().cached_input, 3.0);
        let tools = c.tools(&[], Vec::new()).unwrap();
        assert_eq!(tools[0].parameters["properties"]["q"]["type"], "string");
        assert!(
            c.tools(&["nope".into()], Vec::new())
                .unwrap_err()
                .to_string()
                .contains("nope")
        );
        assert!(c.model("x").unwrap_err().to_string().contains("\"m\""));
        let neg = ok.replace("usd = 0.5", "usd = -1.0");
        let c: Config = toml::from_str(&neg).unwrap();
        assert!(c.check().is_err());
        assert!(toml::from_str::<Config>(&format!("{ok}\nsurprise = 1")).is_err());
        let both = ok.replace(
            "command = [\"cat\"]",
            "command = [\"cat\"]\nurl = \"http://127.0.0.1:1/\"",
        );
        let c: Config = toml::from_str(&both).unwrap();
        assert!(c.check().unwrap_err().to_string().contains("exactly one"));
        let url = ok.replace("command = [\"cat\"]", "url = \"ftp://x/\"");
        let c: Config = toml::from_str(&url).unwrap();
        assert!(c.check().is_err());
        for (server, says) in [
            ("name = \"a_b\"\ncommand = \"x\"", "server name"),
            ("name = \"a\"\nurl = \"ftp://x\"", "http:// or https://"),
            (
                "name = \"a\"\nurl = \"http://x\"\nsandbox = true",
                "a url server is not started",
            ),
            (
                "name = \"a\"\ncommand = \"x\"\nsandbox_policy = \"e.toml\"",
                "goes with sandbox = true",
            ),
        ] {
            let c: Config = toml::from_str(&format!("{ok}\n[[server]]\n{server}\n")).unwrap();
            let e = c.check().unwrap_err().to_string();
            assert!(e.contains(says), "{server}: {e}");
        }
        let c: Config = toml::from_str(&format!(
            "{ok}\n[[server]]\nname = \"files\"\ncommand = \"x\"\n"
        ))
        .unwrap();
        c.check().unwrap();
        let c: Config = toml::from_str(&format!(
            "{ok}\n[[server]]\nname = \"files\"\ncommand = \"x\"\nsandbox = true\n"
        ))
        .unwrap();
        c.check().unwrap();
        let listed = Tool {
            name: "files__read".into(),
            mcp: Some(crate::mcp::McpTool {
                server: "files".into(),
                tool: "read".into(),
                changed: None,
            }),
            ..tools[0].clone()
        };
        let picked = c.tools(&["files__read".into()], vec![listed]).unwrap();
        assert_eq!(picked[0].mcp.as_ref().unwrap().tool, "read");
        let sandboxed = ok.replace("read_only = true", "sandbox = true");
        let c: Config = toml::from_str(&sandboxed).unwrap();
        c.check().unwrap();
        assert!(c.tools(&[], Vec::new()).unwrap()[0].sandbox);
        let loose = ok.replace("read_only = true", "sandbox_policy = \"e.toml\"");
        let c: Config = toml::from_str(&loose).unwrap();
        assert!(
            c.check()
                .unwrap_err()
                .to_string()
                .contains("goes with sandbox")
        );
        let egress = ok.replace("read_only = true", "egress_policy = \"e.toml\"");
        let c: Config = toml::from_str(&egress).unwrap();
        assert!(c.check().unwrap_err().to_string().contains("goes with url"));
        let missing = ok.replace(
            "command = [\"cat\"]",
            "url = \"http://127.0.0.1:1/\"\negress_policy = \"/nonexistent/e.toml\"",
        );
        let c: Config = toml::from_str(&missing).unwrap();
        c.check().unwrap();
        let e = c.tools(&[], Vec::new()).unwrap_err().to_string();
        assert!(e.contains("egress_policy"), "{e}");
        // `credentials` goes with url, and names hosts of the tool's store.
        let creds = ok.replace("read_only = true", "credentials = [\"a.example\"]");
        let c: Config = toml::from_str(&creds).unwrap();
        assert!(c.check().unwrap_err().to_string().contains("goes with url"));
        let creds = ok.replace(
            "command = [\"cat\"]",
            "url = \"http://127.0.0.1:1/\"\ncredentials = [\"a.example\"]",
        );
        let c: Config = toml::from_str(&creds).unwrap();
        c.check().unwrap();
        let e = c.tools(&[], Vec::new()).unwrap_err().to_string();
        assert!(
            e.contains("\"a.example\"") && e.contains("no credential"),
            "{e}"
        );
        // A contract: checked whole, and workspace_files needs the workspace lease.
        let contract = format!("{ok}\n[contract]\nworkspace_files = [\"report.md\"]\n");
        let c: Config = toml::from_str(&contract).unwrap();
        assert!(c.check().unwrap_err().to_string().contains("workspaces"));
        let contract = format!("{ok}\n[contract]\nanswer_matches = \"(\"\n");
        let c: Config = toml::from_str(&contract).unwrap();
        assert!(
            c.check()
                .unwrap_err()
                .to_string()
                .contains("answer_matches")
        );
        assert!(toml::from_str::<Config>(&format!("{ok}\n[contract]\nmust_cal = []\n")).is_err());
        let sub = format!("{ok}\n[subagents]\ndepth_max = 1\n");
        let c: Config = toml::from_str(&sub).unwrap();
        c.check().unwrap();
        let tools = c.tools(&[], Vec::new()).unwrap();
        assert!(tools.iter().any(|t| t.name == "delegate" && !t.read_only));
        let clash = format!("{ok}\n[subagents]\ntool = \"echo\"\n");
        let c: Config = toml::from_str(&clash).unwrap();
        assert!(c.check().unwrap_err().to_string().contains("[subagents]"));
        let share = format!("{ok}\n[subagents]\nshare_permille = 0\n");
        let c: Config = toml::from_str(&share).unwrap();
        assert!(c.check().is_err());
        let sep = ok.replace("name = \"echo\"", "name = \"a__b\"");
        let c: Config = toml::from_str(&sep).unwrap();
        assert!(c.check().unwrap_err().to_string().contains("kept for MCP"));
    }

    /// The retry policy: the defaults when left out, as given otherwise, and each bound
    /// refused at load naming the model.
    #[test]
    fn a_models_retry_policy_defaults_and_is_bounded() {
        let base = "[[model]]\nname = \"m\"\nbase_url = \"http://127.0.0.1:1/v1\"\nusd_per_mtok_input = 1.0\nusd_per_mtok_output = 1.0\n";
        let c: Config = toml::from_str(base).unwrap();
        c.check().unwrap();
        assert_eq!(c.models[0].retry(), crate::retry::DEFAULT);
        let c: Config = toml::from_str(&format!(
            "{base}retry_base_ms = 100\nretry_cap_ms = 2000\nretries_max = 3\nretry_after_max_ms = 5000\n"
        ))
        .unwrap();
        c.check().unwrap();
        assert_eq!(
            c.models[0].retry(),
            crate::retry::Retry {
                base_ms: 100,
                cap_ms: 2_000,
                retries_max: 3,
                retry_after_max_ms: 5_000
            }
        );
        for bad in [
            "retry_base_ms = 0",
            "retry_base_ms = 40000",
            "retries_max = 101",
            "retry_cap_ms = 100000000",
            "retry_after_max_ms = 100000000",
        ] {
            let c: Config = toml::from_str(&format!("{base}{bad}\n")).unwrap();
            let e = c.check().unwrap_err().to_string();
            assert!(
                e.contains("model \"m\"") && e.contains("retr"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn the_journal_section_is_optional_and_checked() {
        let base = "[[model]]\nname = \"m\"\nbase_url = \"http://127.0.0.1:1/v1\"\nusd_per_mtok_input = 1.0\nusd_per_mtok_output = 1.0\n";
        let c: Config = toml::from_str(base).unwrap();
        assert_eq!(c.journal, crate::journal::JournalOptions::default());
        let c: Config = toml::from_str(&format!(
            "{base}[journal]\nended_keep = 5\ncompact_bytes = 1\n"
        ))
        .unwrap();
        c.check().unwrap();
        assert_eq!((c.journal.ended_keep, c.journal.compact_bytes), (5, 1));
        let c: Config = toml::from_str(&format!("{base}[journal]\ncompact_bytes = 0\n")).unwrap();
        assert!(c.check().unwrap_err().to_string().contains("compact_bytes"));
        let c: Config =
            toml::from_str(&format!("{base}[journal]\nsegment_bytes_max = 1024\n")).unwrap();
        assert!(
            c.check()
                .unwrap_err()
                .to_string()
                .contains("segment_bytes_max")
        );
        assert!(toml::from_str::<Config>(&format!("{base}[journal]\nkeep = 1\n")).is_err());
    }

    /// An HTTP tool's method, path and headers: parsed, checked at load, and each refusal
    /// names the tool.
    #[test]
    fn an_http_tools_method_path_and_headers_are_checked_naming_the_tool() {
        let base = "[[model]]\nname = \"m\"\nbase_url = \"http://127.0.0.1:1/v1\"\nusd_per_mtok_input = 1.0\nusd_per_mtok_output = 1.0\n\n[[tool]]\nname = \"orders\"\nurl = \"https://orders.test/api\"\n";
        let ok = format!(
            "{base}method = \"PUT\"\npath = \"/orders/{{order_id}}\"\nheaders = {{ X-Tenant = \"acme\" }}\n"
        );
        let c: Config = toml::from_str(&ok).unwrap();
        c.check().unwrap();
        let t = &c.tools(&[], Vec::new()).unwrap()[0];
        assert_eq!(t.http.method, crate::http::Method::Put);
        assert_eq!(t.http.path.as_deref(), Some("/orders/{order_id}"));
        assert_eq!(t.http.headers["X-Tenant"], "acme");
        let bad = |extra: &str| -> String {
            let c: Config = toml::from_str(&format!("{base}{extra}")).unwrap();
            c.check().unwrap_err().to_string()
        };
        for (extra, why) in [
            (
                "headers = { Authorization = \"Bearer x\" }",
                "header \"Authorization\"",
            ),
            ("headers = { Cookie = \"a=b\" }", "header \"Cookie\""),
            ("headers = { Host = \"x\" }", "header \"Host\""),
            (
                "headers = { Proxy-Authorization = \"x\" }",
                "header \"Proxy-Authorization\"",
            ),
            ("path = \"orders\"", "must start with /"),
            ("path = \"/orders/{id\"", "without its }"),
        ] {
            let e = bad(extra);
            assert!(
                e.starts_with("tool \"orders\": ") && e.contains(why),
                "{extra}: {e}"
            );
        }
        let e = bad("method = \"TRACE\"");
        assert!(e.starts_with("tool \"orders\": method \"TRACE\""), "{e}");
        let c: Config = toml::from_str(&format!("{base}method = \"delete\"\n")).unwrap();
        c.check().unwrap();
        let cmd = base.replace("url = \"https://orders.test/api\"", "command = [\"cat\"]");
        let c: Config = toml::from_str(&format!("{cmd}method = \"GET\"\n")).unwrap();
        let e = c.check().unwrap_err().to_string();
        assert!(
            e.contains("tool \"orders\"") && e.contains("go with url"),
            "{e}"
        );
    }

    /// A tool's environment: `env_pass` naming a model's key or a credential store's variable,
    /// `env` or `env_pass` naming estop's own, a key on the allow-list, and `env` on an HTTP
    /// tool are each refused naming the tool (or the model) and the variable.
    #[test]
    fn a_tools_environment_refuses_secrets_naming_the_tool() {
        // A variable this test process has and the allow-list does not: the store's source.
        let (var, _) = std::env::vars()
            .find(|(k, v)| !crate::env::allowed(k) && !k.starts_with("ESTOP_") && !v.is_empty())
            .expect("the test runs with some environment");
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store.toml");
        std::fs::write(
            &store,
            format!("[[credential]]\nhost = \"o.example\"\nbearer_env = \"{var}\"\n"),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&store, std::fs::Permissions::from_mode(0o600)).unwrap();
        let egress = dir.path().join("egress.toml");
        std::fs::write(
            &egress,
            format!(
                "[egress]\ncredentials = {:?}\n",
                store.display().to_string()
            ),
        )
        .unwrap();
        let base = format!(
            "[[model]]\nname = \"m\"\nbase_url = \"http://127.0.0.1:1/v1\"\napi_key_env = \"THE_KEY\"\n\
             usd_per_mtok_input = 1.0\nusd_per_mtok_output = 1.0\n\n[[tool]]\nname = \"fetch\"\n\
             url = \"http://o.example/\"\negress_policy = {:?}\n\n[[tool]]\nname = \"show\"\ncommand = [\"env\"]\n",
            egress.display().to_string()
        );
        let load = |extra: &str| -> Result<Vec<Tool>, ConfigError> {
            let c: Config = toml::from_str(&format!("{base}{extra}"))
                .map_err(|e| ConfigError::Invalid(e.to_string()))?;
            c.check()?;
            c.tools(&[], Vec::new())
        };
        let ok = load("env_pass = [\"PGHOST\"]\nenv = { A = \"1\" }\n").unwrap();
        assert_eq!(ok[1].env.pass, ["PGHOST"]);
        assert_eq!(ok[1].env.set["A"], "1");
        for (extra, says) in [
            ("env_pass = [\"THE_KEY\"]\n", "provider key of model \"m\""),
            (
                &format!("env_pass = [{var:?}]\n"),
                "tool \"fetch\"'s egress_policy store",
            ),
            ("env_pass = [\"ESTOP_TOKEN\"]\n", "estop's own"),
            ("env = { ESTOP_SOCKET = \"x\" }\n", "estop's own"),
        ] {
            let e = load(extra).unwrap_err().to_string();
            assert!(
                e.starts_with("tool \"show\": env: ") && e.contains(says),
                "{extra}: {e}"
            );
        }
        let e = load("").map(|_| ()).and_then(|_| {
            let c: Config = toml::from_str(&base.replace("THE_KEY", "HOME")).unwrap();
            c.check()?;
            c.tools(&[], Vec::new()).map(|_| ())
        });
        assert!(e.unwrap_err().to_string().contains("allow-list"));
        let http = base.replace("egress_policy", "env_pass = [\"X\"]\negress_policy");
        let c: Config = toml::from_str(&http).unwrap();
        let e = c.check().unwrap_err().to_string();
        assert!(
            e.contains("tool \"fetch\"") && e.contains("go with command"),
            "{e}"
        );
    }

    /// docs/HARNESS.md stays true: its config example parses and passes the checks, with the
    /// `[subagents]` tool and the workspace root it shows.
    #[test]
    fn the_documented_config_parses() {
        let doc = include_str!("../../../docs/HARNESS.md");
        let block = doc
            .split("```toml\n")
            .nth(1)
            .and_then(|b| b.split("```").next())
            .unwrap();
        let c: Config = toml::from_str(block).unwrap();
        c.check().unwrap();
        assert_eq!(c.subagents.as_ref().unwrap().tool, "delegate");
        assert!(c.harness.workspaces.is_some());
        let fetch = c.tools.iter().find(|t| t.name == "fetch_order").unwrap();
        assert!(fetch.egress_policy.is_some() && fetch.url.is_some());
    }
}
