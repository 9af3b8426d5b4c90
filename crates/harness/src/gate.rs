//! The harness's way to the estop gate, through the typed blocking client
//! (`estop_server::client`): a trajectory is a run, each tool call an effect keyed by the
//! model's tool call id, admitted two-phase (admit, then start at dispatch, then complete).
//! Each call runs on the blocking pool with its own connection. Subscriptions and approval
//! waits are not here: they share one asynchronous connection (crate::mux).

use crate::record::{Admission, Control, Decision};
use estop_protocol::server_line::VerdictReply;
use estop_protocol::{Event, EventKind, Fields, Op, Verb};
use estop_server::client::Client;
use serde_json::{Value, json};

#[derive(Debug, Clone)]
pub struct GateConfig {
    /// The daemon's socket path (or host:port).
    pub target: String,
    /// An agent token: the runs belong to it.
    pub token: String,
}

pub(crate) fn op(verb: Verb, fields: &Value) -> Result<Op, String> {
    let mut f = Fields::new();
    for (k, v) in fields.as_object().expect("an object") {
        f.json(k, v);
    }
    f.build(verb).map(|r| r.op).map_err(|e| e.to_string())
}

/// Whether `id` is a run id the gate accepts (checked by the protocol's own parser), so a
/// trajectory that could never act is refused before it starts.
pub fn check_run_id(id: &str) -> Result<(), String> {
    op(Verb::Status, &json!({ "run": id })).map(|_| ())
}

impl GateConfig {
    fn connect(&self) -> Result<Client, String> {
        Client::connect_as(&self.target, &self.token).map_err(|e| e.to_string())
    }

    fn verdict(&self, verb: Verb, fields: Value) -> Result<VerdictReply, String> {
        let mut c = self.connect()?;
        c.ask(&op(verb, &fields)?).map_err(|e| e.to_string())
    }

    fn ack(&self, verb: Verb, fields: Value) -> Result<(), String> {
        let mut c = self.connect()?;
        c.request(&op(verb, &fields)?)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// Admits one proposed call, two-phase. Arguments that are not JSON are refused here.
    pub fn admit(
        &self,
        run: &str,
        parent: Option<&str>,
        key: &str,
        tool: &str,
        args: &str,
    ) -> Admission {
        self.admit_held_for(run, parent, key, tool, args, None)
    }

    /// [`GateConfig::admit`], and with `hold` the call needs an operator's approval whatever
    /// the policy says, `hold` the label saying why (`mcp.pin`: an MCP tool's words changed
    /// since they were pinned, as `estop mcp` holds it).
    pub fn admit_held_for(
        &self,
        run: &str,
        parent: Option<&str>,
        key: &str,
        tool: &str,
        args: &str,
        hold: Option<&str>,
    ) -> Admission {
        let Ok(args) = serde_json::from_str::<Value>(args) else {
            return Admission::Refused {
                reason: "invalid_arguments".into(),
            };
        };
        self.admit_value(run, parent, key, tool, args, hold)
    }

    /// Admits an HTTP tool call's request two-phase under the call's run `run` (a child of
    /// `parent`, the trajectory's), on a connection that speaks for that run (`hello {token,
    /// run}`: the principal `TOKEN/RUN`), as the call's proxy does (estop_egress::tool): the
    /// run belongs to that principal, so the proxy may start the effect.
    pub fn admit_request(
        &self,
        run: &str,
        parent: &str,
        key: &str,
        tool: &str,
        args: Value,
    ) -> Admission {
        let asked = (|| {
            let hello = op(Verb::Hello, &json!({"token": self.token, "run": run}))?;
            let mut c = Client::connect(&self.target).map_err(|e| e.to_string())?;
            c.request(&hello).map_err(|e| e.to_string())?;
            let fields = json!({"run": run, "parent": parent, "key": key, "tool": tool,
                "args": args, "start": false});
            c.ask::<VerdictReply>(&op(Verb::Admit, &fields)?)
                .map_err(|e| e.to_string())
        })();
        match asked {
            Ok(v) => admission(v),
            Err(e) => Admission::Refused {
                reason: format!("gate: {e}"),
            },
        }
    }

    /// [`GateConfig::admit_held_for`] of arguments already JSON.
    fn admit_value(
        &self,
        run: &str,
        parent: Option<&str>,
        key: &str,
        tool: &str,
        args: Value,
        hold: Option<&str>,
    ) -> Admission {
        let mut fields =
            json!({"run": run, "key": key, "tool": tool, "args": args, "start": false});
        if let Some(p) = parent {
            fields["parent"] = json!(p);
        }
        if let Some(why) = hold {
            fields["needs_approval"] = json!(true);
            fields["labels"] = json!({"mcp.pin": why});
        }
        match self.verdict(Verb::Admit, fields) {
            Ok(v) => admission(v),
            Err(e) => Admission::Refused {
                reason: format!("gate: {e}"),
            },
        }
    }

    /// The commit point: `Ok(())` on `go`; otherwise why it may not start.
    pub fn start(&self, run: &str, key: &str, token: &str) -> Result<(), String> {
        match self.verdict(Verb::Start, json!({"run": run, "key": key, "token": token}))? {
            VerdictReply::Go => Ok(()),
            other => Err(format!("{other:?}")),
        }
    }

    pub fn complete(
        &self,
        run: &str,
        key: &str,
        token: &str,
        outcome: &str,
        result: &str,
    ) -> Result<(), String> {
        let mut fields = json!({"run": run, "key": key, "token": token, "outcome": outcome});
        if outcome == "ok" {
            fields["result"] = json!(result);
        } else {
            fields["error"] = json!(result);
        }
        self.ack(Verb::Complete, fields)
    }

    pub fn close(&self, run: &str, completed: bool) -> Result<(), String> {
        let outcome = if completed { "completed" } else { "failed" };
        self.ack(Verb::Close, json!({"run": run, "outcome": outcome}))
    }

    pub fn cancel(&self, run: &str, reason: &str) -> Result<(), String> {
        self.ack(Verb::Cancel, json!({"run": run, "reason": reason}))
    }
}

/// What an event of the run asks of the trajectory: a stop (a kill when the run's stop cause
/// says `killed`: it acts at once, even mid-turn), a pause or a resume.
pub(crate) fn control_of(e: &Event, killed: bool) -> Option<Control> {
    let reason = e
        .reason
        .clone()
        .unwrap_or_else(|| "stopped at the gate".into());
    Some(match e.event {
        EventKind::Cancelled | EventKind::Finalizing if killed => Control::Kill { reason },
        EventKind::Cancelled | EventKind::Finalizing => Control::Cancel { reason },
        EventKind::Paused => Control::Pause,
        EventKind::Resumed => Control::Resume,
        _ => return None,
    })
}

/// The decision a `wait`'s answer is, `None` while the call is still held. Only an admission
/// is an approval; everything else is a refusal (silence is no).
pub(crate) fn decision_of(v: VerdictReply) -> Option<Decision> {
    Some(match v {
        VerdictReply::Held { .. } => return None,
        VerdictReply::Admitted { token, .. } => Decision::Approved { token },
        VerdictReply::Refused { reason, .. } => match reason.as_str() {
            "expired" => Decision::Expired,
            "cancelled" | "closed" => Decision::Canceled,
            _ => Decision::Denied,
        },
        _ => Decision::Canceled,
    })
}

fn admission(v: VerdictReply) -> Admission {
    match v {
        VerdictReply::Admitted { token, .. } => Admission::Admitted { token },
        VerdictReply::Held { expires_at, .. } => Admission::Held {
            // A sibling or pause hold has no expiry of its own: the gate's wait decides.
            expires_at_ms: expires_at.unwrap_or(u64::MAX),
        },
        VerdictReply::Refused { reason, .. } => Admission::Refused {
            reason: reason.as_str().to_string(),
        },
        VerdictReply::Duplicate {
            status,
            outcome,
            result,
            error,
        } => Admission::Duplicate {
            status,
            outcome: match (outcome.as_deref(), result, error) {
                (Some("ok"), Some(r), _) => Some(
                    r.as_str()
                        .map(str::to_string)
                        .unwrap_or_else(|| r.to_string()),
                ),
                (Some(o), _, e) => {
                    Some(json!({"status": "REPLAYED", "outcome": o, "error": e}).to_string())
                }
                (None, _, _) => None,
            },
        },
        VerdictReply::Go => Admission::Refused {
            reason: "unexpected go".into(),
        },
    }
}
