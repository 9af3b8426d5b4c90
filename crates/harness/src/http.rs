//! HTTP tools through the egress proxy. An HTTP tool call is admitted at the gate under the
//! trajectory's run like any tool call (its name, key = the call's id); at dispatch it gets a
//! run of its own, `TRAJECTORY/CALL_ID`, a child of the trajectory's (as a sandboxed command
//! does), and the arguments are POSTed to the tool's URL through `estop_egress::tool`'s proxy
//! for that run. So the request itself is an `http.POST` effect the gate's policy admits by
//! host and path (`estop report TRAJECTORY/CALL_ID`), the tool's `[egress] credentials` are
//! injected for the exact destination after admission (never in the arguments the model wrote,
//! the journal or the ledger), refused destinations stay refused, and a cancel of the
//! trajectory (which the gate cascades to the call's run) or a cut of the call fences the proxy
//! and cuts the request in flight.

use crate::chat::ToolCall;
use crate::gate::GateConfig;
use bytes::Bytes;
use estop_egress::credentials::Credentials;
use estop_egress::settings::Settings;
use estop_egress::tool::{ToolProxy, ToolProxyOptions};
use http_body_util::{BodyExt, Full};
use serde_json::Value;
use std::sync::Arc;

/// Largest answer an HTTP tool may give (what the model will read of it).
pub const HTTP_TOOL_BYTES_MAX: usize = 1 << 20;

/// How an HTTP tool's requests go out: the `[egress]` settings (`egress_policy` in the tool's
/// config; the defaults without it) and the credential store they name, loaded once at start.
#[derive(Debug, Clone, Default)]
pub struct Egress {
    pub settings: Settings,
    pub credentials: Arc<Credentials>,
}

impl Egress {
    /// Loads the settings file and its credential store (a store others can read, or a
    /// variable it names that is not set, is an error that names the file, never a secret).
    pub fn load(path: &std::path::Path) -> anyhow::Result<Egress> {
        let settings = Settings::load(path)?;
        let credentials = match &settings.credentials {
            Some(p) => Credentials::load(p, &|name| std::env::var(name).ok())?,
            None => Credentials::default(),
        };
        Ok(Egress {
            settings,
            credentials: Arc::new(credentials),
        })
    }
}

/// The tool's outcome at the gate (`ok`, `error`, `unknown`) and the observation the model
/// reads.
pub type Outcome = (&'static str, String);

/// Runs one admitted, started HTTP tool call as the child run `RUN/CALL_ID`; dropped mid-way
/// (the runner aborts a cut call), its proxy is dropped with it, which fences the proxy.
pub async fn call(
    gate: &GateConfig,
    run: &str,
    call: &ToolCall,
    url: &str,
    egress: &Egress,
) -> Outcome {
    let child = format!("{run}/{}", call.id);
    if let Err(e) = crate::gate::check_run_id(&child) {
        return (
            "error",
            format!("the call's run {child:?} cannot be a run id: {e}"),
        );
    }
    let opts = ToolProxyOptions {
        target: gate.target.clone(),
        token: gate.token.clone(),
        run: child.clone(),
        parent: run.to_string(),
        settings: egress.settings.clone(),
        credentials: egress.credentials.clone(),
    };
    let proxy = match ToolProxy::start(opts).await {
        Ok(p) => p,
        Err(e) => return ("error", format!("the tool's proxy could not start: {e:#}")),
    };
    // A request the gate holds waits in the proxy up to `hold_ms`, then is sent again (the
    // same effect: its key is the call's id) until it is decided or the tool deadline cuts it.
    let outcome = loop {
        match send(proxy.addr, &proxy.secret, url, call).await {
            Sent::Held => continue,
            Sent::Done(o) => break o,
        }
    };
    proxy.finish(outcome.0 == "ok").await;
    outcome
}

enum Sent {
    Held,
    Done(Outcome),
}

/// One request through the proxy (absolute form, over loopback): the arguments as the JSON
/// body, the call's id as `Idempotency-Key` (the child run's effect is `idem:CALL_ID`).
async fn send(proxy: std::net::SocketAddr, secret: &str, url: &str, call: &ToolCall) -> Sent {
    let failed = |m: String| Sent::Done(("error", m));
    let tcp = match tokio::net::TcpStream::connect(proxy).await {
        Ok(t) => t,
        Err(e) => return failed(format!("cannot reach the tool's proxy: {e}")),
    };
    tcp.set_nodelay(true).ok();
    let uri: hyper::Uri = match url.parse() {
        Ok(u) => u,
        Err(e) => return failed(format!("{url:?}: {e}")),
    };
    let host = uri.authority().map_or("", |a| a.as_str()).to_string();
    let request = hyper::Request::post(uri)
        .header("host", host)
        .header("content-type", "application/json")
        .header("accept", "application/json")
        .header("idempotency-key", call.id.as_str())
        .header("proxy-authorization", format!("Bearer {secret}"))
        .body(Full::new(Bytes::from(call.function.arguments.clone())));
    let request = match request {
        Ok(r) => r,
        Err(e) => return failed(e.to_string()),
    };
    let io = hyper_util::rt::TokioIo::new(tcp);
    let (mut sender, conn) = match hyper::client::conn::http1::handshake(io).await {
        Ok(x) => x,
        Err(e) => return failed(format!("the tool's proxy: {e}")),
    };
    tokio::spawn(conn);
    let resp = match sender.send_request(request).await {
        Ok(r) => r,
        Err(e) => return failed(format!("the tool's proxy: {e}")),
    };
    let status = resp.status().as_u16();
    let verdict = resp
        .headers()
        .get("x-estop-verdict")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = match read(resp.into_body()).await {
        Ok(b) => b,
        // Sent, and cut before its end (a stop, a broken upstream, the bound): whether it
        // acted is not known.
        Err(e) if verdict == "admitted" => return Sent::Done(("unknown", e)),
        Err(e) => return failed(e),
    };
    if verdict == "admitted" {
        return Sent::Done(match status {
            200..=299 => ("ok", body),
            _ => ("error", format!("HTTP {status}: {body}")),
        });
    }
    let estop: Value = serde_json::from_str::<Value>(&body)
        .map(|v| v["estop"].clone())
        .unwrap_or(Value::Null);
    match estop["verdict"].as_str().unwrap_or(&verdict) {
        "held" => Sent::Held,
        "refused" | "duplicate" => Sent::Done(("error", refused(call, &estop))),
        _ => {
            let why = estop["message"].as_str().unwrap_or(&body);
            failed(format!("the request was not answered ({status}): {why}"))
        }
    }
}

/// The structured refusal the model reads (seed 004), from the proxy's `{"estop": …}` answer:
/// a reviewer's rejection or an expiry under the approval gate's names, any other reason as
/// the gate gave it.
fn refused(call: &ToolCall, estop: &Value) -> String {
    let reason = match estop["reason"].as_str() {
        Some("rejected") => "APPROVAL_DENIED".to_string(),
        Some("expired") => "APPROVAL_EXPIRED".to_string(),
        Some(r) => r.to_uppercase(),
        None => estop["verdict"]
            .as_str()
            .unwrap_or("refused")
            .to_uppercase(),
    };
    let message = estop["message"]
        .as_str()
        .unwrap_or("the gate refused this request; nothing was sent");
    let m = crate::record::refusal(call, &reason, message);
    m.content.unwrap_or_default()
}

/// The whole body, up to [`HTTP_TOOL_BYTES_MAX`].
async fn read(mut body: hyper::body::Incoming) -> Result<String, String> {
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("the answer broke off: {e}"))?;
        if let Ok(d) = frame.into_data() {
            out.extend_from_slice(&d);
            if out.len() > HTTP_TOOL_BYTES_MAX {
                return Err(format!("the answer is over {HTTP_TOOL_BYTES_MAX} bytes"));
            }
        }
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call() -> ToolCall {
        serde_json::from_value(json!({"id": "c1", "type": "function",
            "function": {"name": "fetch", "arguments": "{\"id\":7}"}}))
        .unwrap()
    }

    #[test]
    fn a_refusal_reads_as_seed_004s() {
        let r = refused(
            &call(),
            &json!({"verdict": "refused", "reason": "rejected", "message": "no"}),
        );
        let v: Value = serde_json::from_str(&r).unwrap();
        assert_eq!(
            v,
            json!({"status": "REFUSED", "reason": "APPROVAL_DENIED",
                "call": "fetch({\"id\":7})", "message": "no"})
        );
        let r = refused(
            &call(),
            &json!({"verdict": "refused", "reason": "destination"}),
        );
        assert!(r.contains("\"DESTINATION\""), "{r}");
    }
}
