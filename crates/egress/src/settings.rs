//! The sandbox's own settings (`estop run --policy FILE`, table `[egress]`): which private
//! destinations the proxy may reach, how long a held request waits, the sandbox's bounds.
//! What an HTTP request *may do* is not here: the gate's policy decides that (G7).

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use std::net::IpAddr;
use std::path::Path;

#[derive(Debug, Clone)]
pub struct Settings {
    /// Destinations refused by default (loopback, link-local, metadata…) that the proxy may
    /// reach anyway: address/prefix pairs.
    pub allow: Vec<(IpAddr, u8)>,
    /// How long a held request waits for an operator before the structured refusal.
    pub hold_ms: u64,
    /// Processes and threads the sandbox may have at once (where a pids controller exists).
    pub pids_max: u32,
    /// Bytes of memory the sandbox's processes may hold (cgroup `memory.max`, swap none),
    /// where a memory controller exists; past it the kernel's OOM killer ends one of them.
    pub memory_max: u64,
    /// Largest request body the proxy buffers (it must digest it before admission).
    pub body_bytes_max: usize,
    /// Largest response the proxy relays.
    pub response_bytes_max: usize,
    /// Largest request body recorded in a write's result, as JSON text, for an undo that needs
    /// it (`result.request_body`, docs/EGRESS.md "What an undo needs"); 0 records none. At
    /// most `UNDO_BODY_BYTES_LIMIT`, so the result fits the ledger's `result_bytes_max`.
    pub undo_body_bytes_max: usize,
    /// Connections the sandbox may hold open at once to the proxy, and as many to its protocol
    /// socket: each may buffer a body and a response in the supervisor, whose memory is the
    /// host's. Past it a connection is refused with a reply that says so.
    pub connections_max: usize,
    /// Extra roots (PEM) the proxy trusts when it reaches hosts over TLS, beside the public web
    /// PKI: a private CA of your own, or a test's.
    pub upstream_roots: Option<std::path::PathBuf>,
    /// The credential store (docs/EGRESS.md, "Credentials"): a file 0600, hidden inside the
    /// sandbox.
    pub credentials: Option<std::path::PathBuf>,
    /// The metered model endpoint (`[egress.model]`), when a provider is configured.
    pub model: Option<ModelSettings>,
    /// Origins (`host:port`) whose CONNECT tunnels are passed through opaque instead of
    /// terminated: for clients that pin their server's certificate. The tunnel itself is the
    /// effect (`http.CONNECT`); what travels inside it is not seen, so not gated one by one.
    pub passthrough: Vec<(String, u16)>,
    /// The Landlock filesystem ruleset (`[egress.filesystem]`); none: the caller's filesystem.
    pub filesystem: Option<crate::fsrules::Filesystem>,
    /// Query parameters whose values never reach the record (`secret_params`): lower-cased
    /// names, compared with a request's parameter names percent-decoded and lower-cased. The
    /// effect's arguments carry `REDACTED` for their values and `query_sha256`, the digest of
    /// the query as sent (docs/EGRESS.md, "HTTP requests as effects").
    pub secret_params: Vec<String>,
}

/// `memory_max` unless the settings say otherwise: 4 GiB, room for an agent's interpreters and
/// tools, and a bound a memory bomb meets before the host does (on hosts with more).
pub const MEMORY_MAX_DEFAULT: u64 = 4 << 30;

/// The least `memory_max` may be: the sandbox's own two stages and an interpreter's start.
pub const MEMORY_MAX_MIN: u64 = 16 << 20;

/// The most `secret_params` names, and the longest one (bytes).
pub const SECRET_PARAMS_MAX: usize = 64;
pub const SECRET_PARAM_BYTES_MAX: usize = 128;

/// The most `undo_body_bytes_max` may be: with the response's recorded body
/// (`record::BODY_BYTES_MAX`, 32 KiB) the result stays within the ledger's 64 KiB.
pub const UNDO_BODY_BYTES_LIMIT: usize = 24 << 10;

impl Default for Settings {
    fn default() -> Self {
        Settings {
            allow: Vec::new(),
            hold_ms: 30_000,
            pids_max: 4096,
            memory_max: MEMORY_MAX_DEFAULT,
            body_bytes_max: 8 << 20,
            response_bytes_max: 64 << 20,
            undo_body_bytes_max: 16 << 10,
            connections_max: 64,
            upstream_roots: None,
            credentials: None,
            model: None,
            passthrough: Vec::new(),
            filesystem: None,
            secret_params: Vec::new(),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    egress: Option<Egress>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Egress {
    allow_destinations: Option<Vec<String>>,
    hold_ms: Option<u64>,
    pids_max: Option<u32>,
    memory_max: Option<u64>,
    body_bytes_max: Option<usize>,
    response_bytes_max: Option<usize>,
    undo_body_bytes_max: Option<usize>,
    connections_max: Option<usize>,
    upstream_roots: Option<std::path::PathBuf>,
    credentials: Option<std::path::PathBuf>,
    model: Option<ModelFile>,
    passthrough: Option<Vec<String>>,
    filesystem: Option<crate::fsrules::Filesystem>,
    secret_params: Option<Vec<String>>,
}

impl Settings {
    pub fn load(path: &Path) -> Result<Settings> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Settings::parse(&text).with_context(|| format!("{}", path.display()))
    }

    pub fn parse(text: &str) -> Result<Settings> {
        let file: File = toml::from_str(text)?;
        let mut s = Settings::default();
        let Some(e) = file.egress else { return Ok(s) };
        for cidr in e.allow_destinations.unwrap_or_default() {
            s.allow.push(parse_cidr(&cidr)?);
        }
        s.hold_ms = e.hold_ms.unwrap_or(s.hold_ms);
        s.pids_max = e.pids_max.unwrap_or(s.pids_max);
        s.memory_max = e.memory_max.unwrap_or(s.memory_max);
        s.body_bytes_max = e.body_bytes_max.unwrap_or(s.body_bytes_max);
        s.response_bytes_max = e.response_bytes_max.unwrap_or(s.response_bytes_max);
        s.undo_body_bytes_max = e.undo_body_bytes_max.unwrap_or(s.undo_body_bytes_max);
        if s.undo_body_bytes_max > UNDO_BODY_BYTES_LIMIT {
            anyhow::bail!(
                "undo_body_bytes_max = {} is over {UNDO_BODY_BYTES_LIMIT}: the result it is \
                 recorded in (beside the response's body) must fit the ledger's 64 KiB",
                s.undo_body_bytes_max
            );
        }
        s.connections_max = e.connections_max.unwrap_or(s.connections_max);
        s.upstream_roots = e.upstream_roots;
        s.credentials = e.credentials;
        s.model = e.model.map(ModelSettings::from_file).transpose()?;
        for origin in e.passthrough.unwrap_or_default() {
            s.passthrough.push(parse_origin(&origin)?);
        }
        if let Some(fs) = &e.filesystem {
            fs.check()?;
        }
        s.filesystem = e.filesystem;
        s.secret_params = parse_secret_params(e.secret_params.unwrap_or_default())?;
        if s.connections_max < 1 {
            bail!("connections_max must be at least 1");
        }
        if s.pids_max < 4 {
            bail!("pids_max must be at least 4");
        }
        if s.memory_max < MEMORY_MAX_MIN {
            bail!("memory_max must be at least {MEMORY_MAX_MIN} bytes (16 MiB)");
        }
        Ok(s)
    }
}

/// `secret_params`: names of query parameters, at most `SECRET_PARAMS_MAX`, each 1 to
/// `SECRET_PARAM_BYTES_MAX` bytes of printable ASCII; kept lower-cased.
fn parse_secret_params(names: Vec<String>) -> Result<Vec<String>> {
    if names.len() > SECRET_PARAMS_MAX {
        bail!(
            "secret_params names {} parameters, more than {SECRET_PARAMS_MAX}",
            names.len()
        );
    }
    names
        .into_iter()
        .map(|n| {
            let printable = n.bytes().all(|b| b.is_ascii_graphic());
            if n.is_empty() || n.len() > SECRET_PARAM_BYTES_MAX || !printable {
                bail!(
                    "secret_params {n:?} is not a parameter name (1 to \
                     {SECRET_PARAM_BYTES_MAX} printable ASCII characters)"
                );
            }
            Ok(n.to_ascii_lowercase())
        })
        .collect()
}

/// `host:port` of a pass-through origin: a host name or address (IPv6 in brackets), lower-cased,
/// and a port; no patterns (each pinned origin is named).
pub fn parse_origin(text: &str) -> Result<(String, u16)> {
    let bad = || {
        anyhow::anyhow!("passthrough {text:?} is not host:port (e.g. \"pinned.example.com:443\")")
    };
    let (host, port) = text.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().ok().filter(|&p| p > 0).ok_or_else(bad)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let name_ok = !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':'));
    if !name_ok {
        return Err(bad());
    }
    Ok((host.to_ascii_lowercase(), port))
}

/// `10.0.0.0/8`, `127.0.0.1` (a single address), `::1/128`.
pub fn parse_cidr(text: &str) -> Result<(IpAddr, u8)> {
    let (addr, len) = match text.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (text, None),
    };
    let addr: IpAddr = addr
        .parse()
        .with_context(|| format!("{text:?} is not an address or address/prefix"))?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    let len = match len {
        Some(l) => l.parse::<u8>().ok().filter(|&l| l <= max),
        None => Some(max),
    };
    let len = len.with_context(|| format!("{text:?}: prefix length must be 0 to {max}"))?;
    Ok((addr, len))
}

/// Whether `addr` lies in `net`/`len`.
pub fn contains((net, len): (IpAddr, u8), addr: IpAddr) -> bool {
    match (net, addr) {
        (IpAddr::V4(n), IpAddr::V4(a)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            u32::from(n) & mask == u32::from(a) & mask
        }
        (IpAddr::V6(n), IpAddr::V6(a)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            u128::from(n) & mask == u128::from(a) & mask
        }
        _ => false,
    }
}

/// Destinations refused unless allowed: loopback (the host's own services), link-local (cloud
/// metadata lives at 169.254.169.254 and fd00:ec2::254), unspecified, multicast, broadcast,
/// IPv4-mapped forms of those.
pub fn forbidden(addr: IpAddr) -> bool {
    match addr {
        IpAddr::V4(a) => {
            a.is_loopback()
                || a.is_link_local()
                || a.is_unspecified()
                || a.is_multicast()
                || a.is_broadcast()
                || a.octets()[0] == 0
        }
        IpAddr::V6(a) => {
            if let Some(v4) = a.to_ipv4_mapped() {
                return forbidden(IpAddr::V4(v4));
            }
            a.is_loopback()
                || a.is_unspecified()
                || a.is_multicast()
                || (a.segments()[0] & 0xffc0) == 0xfe80
                || a == "fd00:ec2::254"
                    .parse::<std::net::Ipv6Addr>()
                    .expect("literal")
        }
    }
}

/// `[egress.model]` as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelFile {
    pub(crate) provider: String,
    pub(crate) budget_usd: Option<f64>,
    pub(crate) budget_tokens: Option<u64>,
    pub(crate) usd_per_mtok_input: f64,
    pub(crate) usd_per_mtok_cached_input: Option<f64>,
    pub(crate) usd_per_mtok_output: f64,
    pub(crate) max_tokens_default: Option<u64>,
}

/// The provider and the prices, parsed.
#[derive(Debug, Clone)]
pub struct ModelSettings {
    pub scheme: String,
    pub host: String,
    pub port: u16,
    /// The provider's base path (`/v1`): the agent's `/v1/REST` goes to `BASE/REST`.
    pub base_path: String,
    pub budget_usd_micros: Option<u64>,
    pub budget_tokens: Option<u64>,
    /// Given to the gate as the run's `max_spend` / `max_tokens` when `estop run` creates it.
    /// Prices in micro-dollars per token (= dollars per million tokens).
    pub input: f64,
    pub cached_input: f64,
    pub output: f64,
    /// Reserved (and sent as `max_tokens`) when a call names no output bound.
    pub max_tokens_default: u64,
}

impl ModelSettings {
    pub fn from_file(f: ModelFile) -> anyhow::Result<ModelSettings> {
        let uri: hyper::Uri = f
            .provider
            .parse()
            .map_err(|e| anyhow::anyhow!("[egress.model] provider {:?}: {e}", f.provider))?;
        let (scheme, default_port) = match uri.scheme_str() {
            Some("https") => ("https", 443),
            Some("http") => ("http", 80),
            _ => anyhow::bail!("[egress.model] provider must be an http:// or https:// URL"),
        };
        let host = uri
            .host()
            .ok_or_else(|| anyhow::anyhow!("[egress.model] provider has no host"))?;
        let prices = [
            f.usd_per_mtok_input,
            f.usd_per_mtok_cached_input.unwrap_or(f.usd_per_mtok_input),
            f.usd_per_mtok_output,
        ];
        if prices.iter().any(|p| !p.is_finite() || *p < 0.0)
            || f.budget_usd.is_some_and(|b| !b.is_finite() || b < 0.0)
        {
            anyhow::bail!("[egress.model] prices and budget_usd must be finite and not negative");
        }
        Ok(ModelSettings {
            scheme: scheme.into(),
            host: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_ascii_lowercase(),
            port: uri.port_u16().unwrap_or(default_port),
            base_path: uri.path().trim_end_matches('/').to_string(),
            budget_usd_micros: f.budget_usd.map(|b| (b * 1e6).round() as u64),
            budget_tokens: f.budget_tokens,
            input: prices[0],
            cached_input: prices[1],
            output: prices[2],
            max_tokens_default: f.max_tokens_default.unwrap_or(4096),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `secret_params` names are kept lower-cased; an empty, unprintable or over-long name and
    /// too many names are refused saying why.
    #[test]
    fn secret_params_are_checked() {
        let parse = |v: &str| Settings::parse(&format!("[egress]\nsecret_params = {v}\n"));
        assert_eq!(
            parse(r#"["Api_Key"]"#).unwrap().secret_params,
            vec!["api_key"]
        );
        for bad in [
            r#"[""]"#,
            r#"["a b"]"#,
            &format!("[\"{}\"]", "x".repeat(129)),
        ] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains("is not a parameter name"), "{bad}: {e}");
        }
        let many: Vec<String> = (0..65).map(|i| format!("\"p{i}\"")).collect();
        let e = parse(&format!("[{}]", many.join(","))).unwrap_err();
        assert!(e.to_string().contains("more than 64"), "{e}");
    }

    /// docs/EGRESS.md stays true: its `[egress]` example parses, and so does its policy example.
    #[test]
    fn the_documented_examples_parse() {
        let doc = include_str!("../../../docs/EGRESS.md");
        let blocks: Vec<&str> = doc
            .split("```toml\n")
            .skip(1)
            .map(|b| b.split("```").next().unwrap())
            .collect();
        assert_eq!(
            blocks.len(),
            5,
            "the settings, the credential store, the policy example, an HTTP undo's rule and \
             an HTTP lookup's"
        );
        let s = Settings::parse(blocks[0]).unwrap();
        assert_eq!(s.allow, vec![parse_cidr("127.0.0.2/32").unwrap()]);
        assert_eq!(s.undo_body_bytes_max, 16384);
        assert_eq!(s.hold_ms, 30_000);
        assert_eq!(s.secret_params, vec!["api_key", "sig"]);
        let m = s.model.expect("the [egress.model] example");
        assert_eq!(
            (m.host.as_str(), m.budget_usd_micros, m.cached_input),
            ("api.openai.com", Some(5_000_000), 1.25)
        );
        let env = |_: &str| Some("from-env".to_string());
        let store = crate::credentials::Credentials::parse(blocks[1], &env).unwrap();
        assert_eq!(store.entries.len(), 3);
        estop_policy::Policy::parse(blocks[2]).unwrap();
        estop_policy::Policy::parse(blocks[3]).unwrap();
        estop_policy::Policy::parse(blocks[4]).unwrap();
        assert!(
            Settings::parse("[egress]\nhold = 1\n").is_err(),
            "unknown keys are refused"
        );
        assert!(Settings::parse("[egress]\npids_max = 1\n").is_err());
        assert!(Settings::parse("[egress]\nmemory_max = 1048576\n").is_err());
        let s = Settings::parse("[egress]\nmemory_max = 67108864\n").unwrap();
        assert_eq!(s.memory_max, 64 << 20);
        assert_eq!(Settings::default().memory_max, MEMORY_MAX_DEFAULT);
        let over = Settings::parse("[egress]\nundo_body_bytes_max = 24577\n").unwrap_err();
        assert!(
            format!("{over:#}").contains("must fit the ledger"),
            "{over:#}"
        );
        assert_eq!(
            Settings::parse("[egress]\nundo_body_bytes_max = 0\n")
                .unwrap()
                .undo_body_bytes_max,
            0
        );
    }

    #[test]
    fn passthrough_origins_are_named_host_and_port() {
        let s = Settings::parse(
            "[egress]\npassthrough = [\"Pinned.Example.com:443\", \"[2001:db8::1]:8443\"]\n",
        )
        .unwrap();
        assert_eq!(
            s.passthrough,
            vec![
                ("pinned.example.com".to_string(), 443),
                ("2001:db8::1".to_string(), 8443)
            ]
        );
        for bad in [
            "pinned.example.com",
            "*.example.com:443",
            "a.com:0",
            ":443",
            "a b:1",
        ] {
            let text = format!("[egress]\npassthrough = [{bad:?}]\n");
            let e = Settings::parse(&text).unwrap_err();
            assert!(format!("{e:#}").contains("host:port"), "{bad}: {e:#}");
        }
    }

    #[test]
    fn cidrs_and_forbidden_destinations() {
        let lo = parse_cidr("127.0.0.0/8").unwrap();
        assert!(contains(lo, "127.1.2.3".parse().unwrap()));
        assert!(!contains(lo, "128.0.0.1".parse().unwrap()));
        assert!(contains(
            parse_cidr("0.0.0.0/0").unwrap(),
            "203.0.113.8".parse().unwrap()
        ));
        assert!(contains(parse_cidr("::1").unwrap(), "::1".parse().unwrap()));
        assert!(parse_cidr("10.0.0.0/33").is_err());
        assert!(parse_cidr("nope").is_err());
        for bad in [
            "127.0.0.1",
            "169.254.169.254",
            "0.0.0.0",
            "::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "fd00:ec2::254",
            "224.0.0.1",
        ] {
            assert!(forbidden(bad.parse().unwrap()), "{bad}");
        }
        for good in ["198.51.100.34", "10.1.2.3", "2001:db8::1"] {
            assert!(!forbidden(good.parse().unwrap()), "{good}");
        }
    }
}
