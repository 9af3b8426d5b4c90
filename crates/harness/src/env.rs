//! The environment a tool's process starts from: an explicit one, never the runner's. The
//! runner's own environment holds the provider's key (`api_key_env`) and the variables the
//! credential stores read their secrets from; a command tool (sandboxed or not) and a stdio
//! MCP server get only the allow-listed variables ([`ALLOWED`], `LC_*`), the ones its config
//! passes by name (`env_pass`) and the values its config sets (`env`). Secrets reach a tool only
//! through a credential store's injection at the egress proxy, never as variables
//! (docs/HARNESS.md, "The environment of a tool").

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::ffi::OsString;

/// Variables every tool gets from the runner's environment, when they are set: where programs
/// are, who and where the user is, the shell, the locale, the time zone, the terminal and the
/// temporary directory. Nothing else passes unless the tool's config names it.
pub const ALLOWED: &[&str] = &[
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR",
];

/// ...and every variable whose name starts with this (the locale's categories).
pub const ALLOWED_PREFIX: &str = "LC_";

/// Names a tool's config may not set or pass: estop's own (`estop run` and the harness set
/// those themselves).
pub const RESERVED_PREFIX: &str = "ESTOP_";

/// Whether `name` is on the allow-list.
pub fn allowed(name: &str) -> bool {
    ALLOWED.contains(&name) || name.starts_with(ALLOWED_PREFIX)
}

/// What a tool's config adds to the allow-list.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolEnv {
    /// Variables set to these values (`env = { NAME = "value" }`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub set: BTreeMap<String, String>,
    /// Variables passed on from the runner's environment when set there (`env_pass`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pass: Vec<String>,
}

/// The environment built from `vars` (the runner's): the allow-listed variables and those
/// `pass` names, then `set` over them. Sorted by name; a name that is not UTF-8 never passes.
pub fn explicit(
    vars: impl IntoIterator<Item = (OsString, OsString)>,
    pass: &[String],
    set: &BTreeMap<String, String>,
) -> Vec<(OsString, OsString)> {
    let mut out: BTreeMap<OsString, OsString> = vars
        .into_iter()
        .filter(|(k, _)| {
            k.to_str()
                .is_some_and(|k| allowed(k) || pass.iter().any(|p| p == k))
        })
        .collect();
    for (k, v) in set {
        out.insert(k.into(), v.into());
    }
    out.into_iter().collect()
}

/// [`explicit`] from this process's environment.
pub fn for_tool(env: &ToolEnv) -> Vec<(OsString, OsString)> {
    explicit(std::env::vars_os(), &env.pass, &env.set)
}

/// Makes `cmd` start from exactly `env` (nothing of this process's environment beyond it).
pub fn apply(cmd: &mut tokio::process::Command, env: &[(OsString, OsString)]) {
    cmd.env_clear();
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
}

/// The variables `sandbox_policy`'s credential store reads its secrets from: `estop run` needs
/// them in its own environment to load the store, and keeps them from the command it runs.
pub fn store_vars(sandbox_policy: &std::path::Path) -> anyhow::Result<Vec<String>> {
    let settings = estop_egress::settings::Settings::load(sandbox_policy)?;
    Ok(match &settings.credentials {
        Some(p) => {
            estop_egress::credentials::Credentials::load(p, &|name| std::env::var(name).ok())?
                .env_names
        }
        None => Vec::new(),
    })
}

/// Why a tool's config may not set or pass `name`: estop's own, or a secret (`secrets`: the
/// provider keys and the credential stores' source variables, each with what it is).
pub fn refused(name: &str, secrets: &BTreeMap<String, String>) -> Option<String> {
    if name.starts_with(RESERVED_PREFIX) {
        return Some(format!(
            "{name} is estop's own ({RESERVED_PREFIX}*): the harness and estop run set those"
        ));
    }
    secrets.get(name).map(|what| {
        format!(
            "{name} is {what}: a tool gets a secret only through a credential store's \
             injection, never as a variable"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(OsString, OsString)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect()
    }

    /// Only the allow-list, the names passed and the values set; a secret of the runner's
    /// environment that the config did not name never passes.
    #[test]
    fn a_tool_gets_the_allow_list_what_it_passes_and_what_it_sets() {
        let from = vars(&[
            ("PATH", "/bin"),
            ("LC_ALL", "C"),
            ("OPENAI_API_KEY", "sk-secret"),
            ("FOO_SECRET", "x"),
            ("PASSED", "p"),
            ("HOME", "/home/a"),
        ]);
        let set = BTreeMap::from([("HOME".to_string(), "/work".to_string())]);
        let got = explicit(from, &["PASSED".into(), "UNSET".into()], &set);
        assert_eq!(
            got,
            vars(&[
                ("HOME", "/work"),
                ("LC_ALL", "C"),
                ("PASSED", "p"),
                ("PATH", "/bin")
            ])
        );
    }

    #[test]
    fn estops_own_names_and_secrets_are_refused() {
        let secrets = BTreeMap::from([(
            "OPENAI_API_KEY".to_string(),
            "the provider key of model \"m\"".to_string(),
        )]);
        assert!(
            refused("ESTOP_TOKEN", &secrets)
                .unwrap()
                .contains("estop's own")
        );
        let why = refused("OPENAI_API_KEY", &secrets).unwrap();
        assert!(
            why.contains("provider key") && why.contains("injection"),
            "{why}"
        );
        assert_eq!(refused("PASSED", &secrets), None);
    }
}
