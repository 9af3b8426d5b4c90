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
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gateway {
    /// How long a held call waits for an operator before the model is told it is held.
    #[serde(default = "hold_ms_default")]
    pub hold_ms: u64,
}

fn hold_ms_default() -> u64 {
    30_000
}

impl Default for Gateway {
    fn default() -> Self {
        Gateway {
            hold_ms: hold_ms_default(),
        }
    }
}

/// One upstream MCP server, started as a child process speaking MCP over stdio.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Server {
    pub name: String,
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Whether its tool annotations may seed class and reversibility (untrusted: worst case).
    #[serde(default)]
    pub trusted: bool,
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
        let mut seen = std::collections::BTreeSet::new();
        for s in &config.servers {
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
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_configs_are_refused_with_the_reason() {
        let one = "[[server]]\nname = \"files\"\ncommand = \"x\"\n";
        let c = Config::parse(one).unwrap();
        assert_eq!(c.gateway.hold_ms, 30_000);
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
}
