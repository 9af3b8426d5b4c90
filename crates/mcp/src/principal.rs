//! Who a call is made for: an agent principal of the daemon, reached through one gate
//! connection that said hello with its token. On stdio there is one (the gateway's own token);
//! over HTTP each client presents its own estop agent token, so the daemon — not the gateway —
//! decides who it is, and a revoked token stops working at once (its connection closes).
//!
//! A principal also follows its runs' events: once a run is stopped (cancelled, killed,
//! closed), its fence is up, calls in flight in it are cut and new ones refused.

use anyhow::Result;
use estop_egress::gate::Gate;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, watch};

/// How many runs one principal's gateway follows at once; stopped ones are forgotten first.
const RUNS_MAX: usize = 4096;

#[derive(Debug)]
pub struct Principal {
    /// The daemon's name for it (from `hello`).
    pub name: String,
    pub gate: Gate,
    runs: Mutex<BTreeMap<String, Followed>>,
    /// False once the daemon closed the connection (the token was revoked, or the daemon went).
    live: watch::Sender<bool>,
}

#[derive(Debug)]
struct Followed {
    fence: watch::Sender<bool>,
    subscribed: bool,
}

/// Why a principal could not be had for a token.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error("the gate refused the token ({0})")]
    Token(String),
    #[error("an estop agent token is needed here, not a {0} token")]
    Role(String),
    #[error("estop's gate is unreachable: {0:#}")]
    Unreachable(anyhow::Error),
}

impl Principal {
    /// Connects to the daemon at `socket` as `token`'s principal, which must be an agent.
    pub async fn connect(socket: &str, token: &str) -> Result<Arc<Principal>, Refused> {
        let (gate, events) = Gate::open(socket).await.map_err(Refused::Unreachable)?;
        let hello = gate
            .call(json!({"op": "hello", "token": token}))
            .await
            .map_err(Refused::Unreachable)?;
        if hello["ok"] != true {
            let why = hello["error"]["message"]
                .as_str()
                .or(hello["error"].as_str())
                .unwrap_or("unknown token");
            return Err(Refused::Token(why.to_string()));
        }
        if hello["role"] != "agent" {
            return Err(Refused::Role(hello["role"].as_str().unwrap_or("?").into()));
        }
        let principal = Arc::new(Principal {
            name: hello["principal"].as_str().unwrap_or("agent").to_string(),
            gate,
            runs: Mutex::new(BTreeMap::new()),
            live: watch::channel(true).0,
        });
        tokio::spawn(follow(Arc::downgrade(&principal), events));
        Ok(principal)
    }

    /// Whether the daemon still holds the connection open.
    pub fn is_live(&self) -> bool {
        *self.live.borrow()
    }

    /// The fence of `run` (up once the run is stopped), following it from now on.
    pub fn fence(&self, run: &str) -> Result<watch::Receiver<bool>, String> {
        let mut runs = self.runs.lock().expect("not poisoned");
        if !runs.contains_key(run) && runs.len() >= RUNS_MAX {
            runs.retain(|_, f| !*f.fence.borrow());
            if runs.len() >= RUNS_MAX {
                return Err(format!(
                    "this gateway follows {RUNS_MAX} live runs of yours already; end some first"
                ));
            }
        }
        let f = runs.entry(run.to_string()).or_insert_with(|| Followed {
            fence: watch::channel(false).0,
            subscribed: false,
        });
        Ok(f.fence.subscribe())
    }

    /// Subscribes to `run`'s events once it exists (after its first admission), and reads
    /// its state at once: a stop that landed before the subscription still raises the fence.
    pub async fn follow_run(&self, run: &str) -> Result<()> {
        let first = {
            let mut runs = self.runs.lock().expect("not poisoned");
            match runs.get_mut(run) {
                Some(f) if !f.subscribed => {
                    f.subscribed = true;
                    true
                }
                _ => false,
            }
        };
        if first {
            self.gate
                .call(json!({"op": "subscribe", "run": run}))
                .await?;
            self.check(run).await;
        }
        Ok(())
    }

    /// Raises `run`'s fence if the run is stopped.
    async fn check(&self, run: &str) {
        if let Ok(v) = self.gate.call(json!({"op": "status", "run": run})).await
            && v["ok"] == true
            && !v.get("cause").is_none_or(Value::is_null)
            && let Some(f) = self.runs.lock().expect("not poisoned").get(run)
        {
            f.fence.send_replace(true);
        }
    }
}

/// Follows the principal's event stream until the daemon closes the connection.
async fn follow(principal: std::sync::Weak<Principal>, mut events: mpsc::UnboundedReceiver<Value>) {
    while let Some(ev) = events.recv().await {
        let Some(p) = principal.upgrade() else { return };
        let stop = [
            "cancelled",
            "closed",
            "finalizing",
            "settled",
            "resubscribed",
        ];
        if let Some(run) = ev["run"].as_str()
            && stop.contains(&ev["event"].as_str().unwrap_or(""))
        {
            p.check(run).await;
        }
    }
    if let Some(p) = principal.upgrade() {
        p.live.send_replace(false);
    }
}
