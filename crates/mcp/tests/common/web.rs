//! The streamable HTTP front's test helpers: a gateway on a loopback port, agent principals,
//! raw requests.

use super::World;
use serde_json::{Value, json};
use std::time::Duration;

/// A gateway served over HTTP on a fresh loopback port; `extra` is appended to its config
/// (`[gateway]` and `[http]` tables). Calls run in per-session runs (no `--run`).
pub async fn http_gateway(w: &World, name: &str, extra: &str) -> String {
    http_gateway_with(w, name, 30_000, "", extra).await
}

/// `http_gateway` holding calls `hold_ms`, with `gateway` (lines) added to its `[gateway]`.
pub async fn http_gateway_with(
    w: &World,
    name: &str,
    hold_ms: u64,
    gateway: &str,
    extra: &str,
) -> String {
    let mut opts = w.options(name, "Echoes text.", hold_ms);
    opts.run = None;
    let text = std::fs::read_to_string(&opts.config).unwrap();
    let text = text.replacen("[gateway]\n", &format!("[gateway]\n{gateway}\n"), 1);
    // The `[gateway]` table the helper wrote comes first: the extra tables go after the server.
    std::fs::write(&opts.config, format!("{text}\n{extra}\n")).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        estop_mcp::serve_http_on(opts, listener).await.unwrap();
    });
    addr
}

/// A new agent principal's token (each is its own principal to the daemon).
pub fn agent_token(w: &World, name: &str) -> String {
    let v = w.operator(json!({"op": "token", "name": name, "role": "agent"}));
    assert_eq!(v["ok"], true, "{v}");
    v["token"].as_str().unwrap().to_string()
}

pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: String,
}

impl Reply {
    /// The JSON-RPC message in the body (plain JSON, or the last `data:` of an SSE stream).
    pub fn message(&self) -> Value {
        if let Ok(v) = serde_json::from_str(&self.body) {
            return v;
        }
        let data = self
            .body
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(str::trim)
            .rfind(|d| !d.is_empty())
            .unwrap_or_else(|| panic!("no message in {:?}", self.body));
        serde_json::from_str(data).unwrap()
    }
}

/// reqwest's TLS without a provider of its own (as in the gateway): ring.
pub fn http() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

/// One raw POST to the gateway: the MCP client's usual headers, then `headers` over them.
pub async fn post(addr: &str, headers: &[(&str, &str)], body: &Value) -> Reply {
    let mut req = http()
        .post(format!("http://{addr}/mcp"))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    // Bounded only so that a gateway that never answers fails instead of hanging.
    let resp = tokio::time::timeout(Duration::from_secs(60), req.body(body.to_string()).send())
        .await
        .expect("an answer")
        .unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.text().await.unwrap();
    Reply {
        status,
        headers,
        body,
    }
}

pub fn initialize() -> Value {
    json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "raw", "version": "1"}}})
}

/// A 2025-11-25 session over HTTP, by raw requests (rmcp cannot send that revision's tasks).
#[derive(Clone)]
pub struct Session25 {
    pub addr: String,
    pub bearer: String,
    pub id: String,
}

impl Session25 {
    /// Opens a session at 2025-11-25 as `token`; the `tasks` capability is declared.
    pub async fn open(addr: &str, token: &str) -> Session25 {
        let bearer = format!("Bearer {token}");
        let mut init = initialize();
        init["params"]["protocolVersion"] = json!("2025-11-25");
        let r = post(addr, &[("authorization", &bearer)], &init).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let caps = &r.message()["result"]["capabilities"];
        assert_eq!(
            caps["tasks"]["requests"]["tools"]["call"],
            json!({}),
            "{caps}"
        );
        let id = r.headers["mcp-session-id"].to_str().unwrap().to_string();
        let s = Session25 {
            addr: addr.to_string(),
            bearer,
            id,
        };
        let done = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        assert_eq!(post(addr, &s.headers(), &done).await.status, 202);
        s
    }

    fn headers(&self) -> [(&str, &str); 3] {
        [
            ("authorization", self.bearer.as_str()),
            ("mcp-session-id", self.id.as_str()),
            ("mcp-protocol-version", "2025-11-25"),
        ]
    }

    /// One request in the session: its JSON-RPC answer.
    pub async fn send(&self, method: &str, params: Value) -> Value {
        let body = json!({"jsonrpc": "2.0", "id": 7, "method": method, "params": params});
        let r = post(&self.addr, &self.headers(), &body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        r.message()
    }
}
