//! Credentials the proxy injects per host, from a secret store the agent never sees (a file
//! 0600 named by `[egress] credentials`, hidden inside the sandbox, or variables of the
//! supervisor's environment, removed from the sandbox's). A credential is attached only to a
//! request whose admitted destination is exactly its host (and port, and https unless
//! `plain_http`): never to another host, so a redirect elsewhere (which the agent follows as a
//! new request) goes without it. It is added after admission, so it is never in the effect's
//! arguments, the ledger or the report, and it is never logged (`Debug` shows only the host).

use anyhow::{Context, Result, bail};
use base64::Engine;
use hyper::header::{HeaderName, HeaderValue};
use serde::Deserialize;
use std::path::Path;

/// One host's credential, ready to insert.
#[derive(Clone)]
pub struct Credential {
    pub host: String,
    pub port: Option<u16>,
    pub plain_http: bool,
    name: HeaderName,
    value: HeaderValue,
    /// The texts whose appearance in a recorded response means the upstream echoed this
    /// credential: the header's value and the secret in it (docs/EGRESS.md, "What an undo
    /// needs").
    secrets: Vec<String>,
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The value is a secret: never printed, whatever prints the settings.
        write!(f, "Credential({} {}: <redacted>)", self.host, self.name)
    }
}

/// Every credential of the store, and the environment variables they were read from (those
/// are kept out of the sandbox's environment).
#[derive(Clone, Debug, Default)]
pub struct Credentials {
    pub entries: Vec<Credential>,
    pub env_names: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    credential: Vec<Entry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    host: String,
    port: Option<u16>,
    #[serde(default)]
    plain_http: bool,
    bearer: Option<String>,
    bearer_env: Option<String>,
    header: Option<String>,
    value: Option<String>,
    value_env: Option<String>,
    basic_user: Option<String>,
    basic_password: Option<String>,
    basic_password_env: Option<String>,
}

impl Credentials {
    /// Reads the store at `path`: it must be a regular file that only its owner can read or
    /// write (mode 0600 or stricter), else nothing is loaded and `estop run` refuses to start.
    pub fn load(path: &Path, env: &dyn Fn(&str) -> Option<String>) -> Result<Credentials> {
        use std::os::unix::fs::PermissionsExt;
        let meta = std::fs::metadata(path)
            .with_context(|| format!("the credential store {}", path.display()))?;
        if !meta.is_file() {
            bail!("the credential store {} is not a file", path.display());
        }
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            bail!(
                "the credential store {} is mode {mode:o}: make it 0600 (chmod 600), \
                 no one else may read it",
                path.display()
            );
        }
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the credential store {}", path.display()))?;
        Credentials::parse(&text, env)
            .with_context(|| format!("the credential store {}", path.display()))
    }

    pub fn parse(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Credentials> {
        // The parser's own message quotes the offending line, which may hold a secret.
        let file: File = toml::from_str(text).map_err(|e| {
            let at = e.span().map(|s| text[..s.start].lines().count().max(1));
            anyhow::anyhow!("{} (line {})", e.message(), at.unwrap_or(0))
        })?;
        let mut out = Credentials::default();
        for e in file.credential {
            let c = entry(e, env, &mut out.env_names)?;
            if out
                .entries
                .iter()
                .any(|o| o.host == c.host && o.port == c.port && o.name == c.name)
            {
                bail!("two credentials for {} header {}", c.host, c.name);
            }
            out.entries.push(c);
        }
        Ok(out)
    }

    /// The headers to add to a request admitted for `scheme://host:port`.
    pub fn for_request(
        &self,
        scheme: &str,
        host: &str,
        port: u16,
    ) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
        self.entries
            .iter()
            .filter(move |c| {
                c.host == host
                    && c.port.is_none_or(|p| p == port)
                    && (scheme == "https" || c.plain_http)
            })
            .map(|c| (&c.name, &c.value))
    }

    /// The secrets a request to `scheme://host:port` carries (those `for_request` adds), as
    /// texts to look for in what is recorded of its response.
    pub fn secrets_for(&self, scheme: &str, host: &str, port: u16) -> Vec<&str> {
        self.entries
            .iter()
            .filter(|c| {
                c.host == host
                    && c.port.is_none_or(|p| p == port)
                    && (scheme == "https" || c.plain_http)
            })
            .flat_map(|c| c.secrets.iter().map(String::as_str))
            .collect()
    }
}

fn entry(
    e: Entry,
    env: &dyn Fn(&str) -> Option<String>,
    env_names: &mut Vec<String>,
) -> Result<Credential> {
    let host = e.host.to_ascii_lowercase();
    if host.is_empty() || host.contains(['/', ':', '*']) {
        bail!(
            "credential host {:?}: a host name or address only (port apart, no wildcards)",
            e.host
        );
    }
    let mut secret = |inline: Option<String>, var: Option<String>, what: &str| match (inline, var) {
        (Some(v), None) => Ok(v),
        (None, Some(name)) => {
            let v = env(&name).with_context(|| {
                format!("credential for {host}: {name} is not set in estop run's environment")
            })?;
            env_names.push(name);
            Ok(v)
        }
        _ => bail!("credential for {host}: give exactly one of {what} and {what}_env"),
    };
    let (name, value, raw) = match (&e.bearer, &e.bearer_env, &e.header, &e.basic_user) {
        (Some(_), _, None, None) | (None, Some(_), None, None) => {
            let token = secret(e.bearer, e.bearer_env, "bearer")?;
            let value = format!("Bearer {token}");
            ("authorization".to_string(), value, vec![token])
        }
        (None, None, Some(h), None) => {
            let h = h.clone();
            let value = secret(e.value, e.value_env, "value")?;
            (h, value.clone(), vec![value])
        }
        (None, None, None, Some(user)) => {
            let user = user.clone();
            let password = secret(e.basic_password, e.basic_password_env, "basic_password")?;
            let both =
                base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
            (
                "authorization".to_string(),
                format!("Basic {both}"),
                vec![password, both],
            )
        }
        _ => bail!(
            "credential for {host}: give exactly one of bearer, header (with value) or basic_user"
        ),
    };
    let name = HeaderName::try_from(name.as_str())
        .with_context(|| format!("credential for {host}: {name:?} is not a header name"))?;
    let secrets = std::iter::once(value.clone())
        .chain(raw)
        .filter(|s| !s.is_empty())
        .collect();
    let mut value = HeaderValue::try_from(value)
        .map_err(|_| anyhow::anyhow!("credential for {host}: the value is not a header value"))?;
    value.set_sensitive(true);
    Ok(Credential {
        host,
        port: e.port,
        plain_http: e.plain_http,
        name,
        value,
        secrets,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn each_kind_goes_only_to_its_host_and_port_and_over_https_unless_plain_http() {
        let env = |n: &str| (n == "API_TOKEN").then(|| "from-env".to_string());
        let c = Credentials::parse(
            r#"
[[credential]]
host = "API.example.com"
bearer_env = "API_TOKEN"

[[credential]]
host = "keys.example.com"
port = 8443
header = "X-Api-Key"
value = "k1"

[[credential]]
host = "127.0.0.2"
plain_http = true
basic_user = "u"
basic_password = "p"
"#,
            &env,
        )
        .unwrap();
        assert_eq!(c.env_names, vec!["API_TOKEN".to_string()]);
        let got = |scheme, host, port| -> Vec<String> {
            c.for_request(scheme, host, port)
                .map(|(n, v)| format!("{n}: {}", v.to_str().unwrap()))
                .collect()
        };
        assert_eq!(
            got("https", "api.example.com", 443),
            ["authorization: Bearer from-env"]
        );
        assert!(
            got("http", "api.example.com", 80).is_empty(),
            "not over plain HTTP"
        );
        assert!(got("https", "evil.example.com", 443).is_empty());
        assert!(got("https", "api.example.com.evil.test", 443).is_empty());
        assert_eq!(got("https", "keys.example.com", 8443), ["x-api-key: k1"]);
        assert!(
            got("https", "keys.example.com", 443).is_empty(),
            "other port"
        );
        assert_eq!(got("http", "127.0.0.2", 80), ["authorization: Basic dTpw"]);
        let shown = format!("{c:?}");
        assert!(!shown.contains("from-env") && !shown.contains("k1") && !shown.contains("dTpw"));
    }

    #[test]
    fn bad_stores_are_refused_with_the_reason() {
        for (text, why) in [
            ("[[credential]]\nhost = \"a\"\n", "exactly one"),
            (
                "[[credential]]\nhost = \"a\"\nbearer = \"x\"\nbearer_env = \"Y\"\n",
                "exactly one",
            ),
            (
                "[[credential]]\nhost = \"a\"\nbearer_env = \"UNSET\"\n",
                "not set",
            ),
            (
                "[[credential]]\nhost = \"*.a\"\nbearer = \"x\"\n",
                "wildcards",
            ),
            (
                "[[credential]]\nhost = \"a\"\nheader = \"bad name\"\nvalue = \"x\"\n",
                "header name",
            ),
            (
                "[[credential]]\nhost = \"a\"\nbearer = \"x\\n\"\n",
                "header value",
            ),
            (
                "[[credential]]\nhost = \"a\"\nbearer = \"x\"\nsecret = 1\n",
                "unknown field",
            ),
            (
                "[[credential]]\nhost = \"a\"\nbearer = \"x\"\n[[credential]]\nhost = \"a\"\nbearer = \"y\"\n",
                "two credentials",
            ),
        ] {
            let e = format!("{:#}", Credentials::parse(text, &no_env).unwrap_err());
            assert!(e.contains(why), "{text}: {e}");
            assert!(!e.contains("\"x"), "the secret is not echoed: {e}");
        }
    }

    #[test]
    fn a_store_others_can_read_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("creds.toml");
        std::fs::write(&p, "[[credential]]\nhost = \"a\"\nbearer = \"x\"\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = format!("{:#}", Credentials::load(&p, &no_env).unwrap_err());
        assert!(e.contains("0600"), "{e}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(Credentials::load(&p, &no_env).unwrap().entries.len(), 1);
    }
}
