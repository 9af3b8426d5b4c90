//! The proxy of one harness HTTP tool call (crates/harness, docs/HARNESS.md): the proxy `estop
//! run` serves its sandbox, for the call's own run — `TRAJECTORY/CALL`, a child of the
//! trajectory's run, created by its first admission — on a loopback listener that only the
//! harness talks to: every request must carry the proxy's secret (`Proxy-Authorization`), since
//! any local process can reach a loopback port. The request the tool makes is an `http.*` effect that the gate's policy
//! admits by method, host and path under the child run; the credential store of the tool's
//! `[egress]` settings is injected after admission, for the exact destination only; refused
//! destinations (loopback, link-local, metadata) stay refused unless `allow_destinations`.
//!
//! The harness may admit the request it will send before it dispatches the call, two-phase,
//! under the same key and arguments ([`crate::proxy::request_args`]): the proxy's own admission
//! (`start: false`) answers that effect's token, and the proxy's `start`, sent once the upstream
//! connection is ready and just before the write, starts it at the commit point; anything else
//! is admitted as usual.
//!
//! The run is watched: its stop (a cancel or kill of the trajectory cascades to it) fences the
//! proxy and cuts what is in flight, and so does dropping the handle (the harness cut the
//! call: a cancel, a kill, the tool deadline). Either way, and on [`ToolProxy::finish`], the
//! run is closed on the proxy's own gate connection, after every outcome the proxy sent on it.

use crate::credentials::Credentials;
use crate::gate::Gate;
use crate::proxy::Proxy;
use crate::settings::Settings;
use anyhow::{Result, bail};
use estop_kernel::Part;
use serde_json::json;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use tokio::sync::{oneshot, watch};

/// Where the call's proxy speaks to the gate, for which run, under which settings.
#[derive(Debug)]
pub struct ToolProxyOptions {
    /// The daemon's socket (or host:port).
    pub target: String,
    /// The trajectory's agent token: the proxy's connection speaks for the call's run
    /// (`hello {token, run}`), whose principal is `TOKEN/RUN`.
    pub token: String,
    /// The call's run (`TRAJECTORY/CALL`).
    pub run: String,
    /// The trajectory's run, which the call's run is a child of.
    pub parent: String,
    pub settings: Settings,
    pub credentials: Arc<Credentials>,
}

/// A proxy serving on `addr` until [`ToolProxy::finish`]ed or dropped (a drop is a cut).
#[derive(Debug)]
pub struct ToolProxy {
    pub addr: SocketAddr,
    /// What every request must carry as `Proxy-Authorization: Bearer SECRET`: the listener is
    /// on the host's loopback, where any local process could reach it.
    pub secret: String,
    end: Option<oneshot::Sender<bool>>,
    watcher: Option<tokio::task::JoinHandle<()>>,
}

/// Events that say the run stopped.
const STOPS: [&str; 4] = ["cancelled", "closed", "finalizing", "settled"];

impl ToolProxy {
    /// Connects to the gate for `o.run`, subscribes to it (before it exists: the subscription
    /// waits for the run its first admission creates) and serves the proxy on a fresh
    /// `127.0.0.1` port.
    pub async fn start(o: ToolProxyOptions) -> Result<ToolProxy> {
        // The harness's part (`main`), which prepared the request this proxy starts: no
        // sandbox speaks for the call's run, only the harness and this proxy inside it.
        let (gate, mut events, _) = Gate::connect(&o.target, &o.token, &o.run, Part::Main).await?;
        let sub = gate.call(json!({"op": "subscribe", "run": o.run})).await?;
        if sub["ok"] != true {
            bail!(
                "the gate refused to subscribe to {}: {}",
                o.run,
                sub["error"]
            );
        }
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let (fence_tx, fence) = watch::channel(false);
        let secret = crate::random_hex(16);
        let proxy = Arc::new(Proxy {
            ca: None,
            connector: crate::tls::connector(o.settings.upstream_roots.as_deref())?,
            gate: gate.clone(),
            run: o.run.clone(),
            parent: Some(o.parent),
            settings: o.settings,
            credentials: o.credentials,
            fence,
            nonce: crate::random_hex(6),
            seq: 0.into(),
            pool: crate::pool::Pool::default(),
            access: Some(secret.clone()),
        });
        let serving = tokio::spawn(proxy.serve(listener));
        let (end_tx, end) = oneshot::channel::<bool>();
        let run = o.run;
        let watcher = tokio::spawn(async move {
            let stopped = async {
                // Also when the gate's connection ends: no stop can be heard any more, so the
                // proxy closes (fail closed).
                while let Some(ev) = events.recv().await {
                    if ev["run"] != run.as_str() {
                        continue;
                    }
                    let kind = ev["event"].as_str().unwrap_or("");
                    if STOPS.contains(&kind) {
                        return;
                    }
                    // Subscribed again after the gate came back: a stop made while away
                    // is in the run's state.
                    if kind == "resubscribed"
                        && let Ok(v) = gate.call(json!({"op": "status", "run": run})).await
                        && v.get("cause").is_some_and(|c| !c.is_null())
                    {
                        return;
                    }
                }
            };
            // `Ok(completed)`: the call ended; `Err`: the handle was dropped, a cut.
            let completed = tokio::select! {
                r = end => r.ok(),
                () = stopped => None,
            };
            fence_tx.send_replace(true);
            serving.abort();
            let outcome = if completed == Some(true) {
                "completed"
            } else {
                "failed"
            };
            // A run stopped at the gate already (or never created) refuses it: nothing to do.
            let _ = gate
                .call(json!({"op": "close", "run": run, "outcome": outcome}))
                .await;
        });
        Ok(ToolProxy {
            addr,
            secret,
            end: Some(end_tx),
            watcher: Some(watcher),
        })
    }

    /// The call is over (nothing of it in flight): the proxy stops and the run is closed,
    /// `completed` or `failed`; returns once the gate answered the close.
    pub async fn finish(mut self, completed: bool) {
        if let Some(end) = self.end.take() {
            let _ = end.send(completed);
        }
        if let Some(w) = self.watcher.take() {
            let _ = w.await;
        }
    }
}
