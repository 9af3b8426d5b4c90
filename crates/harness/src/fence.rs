//! The run's fence, read at the gate right before every model call (docs/HARNESS.md, "Before
//! each model call"): `status` is answered from the gate's durable state, so a stop the gate
//! acknowledged is seen here whatever order its event and a held call's refusal take to the
//! runner (crate::mux).

use crate::gate::{GateConfig, op};
use crate::record::Control;
use estop_protocol::Verb;
use estop_server::client::Client;
use serde_json::json;

/// The run's fence as the gate's durable state has it, read before every model call
/// ([`GateConfig::fence`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fence {
    /// Not stopped, not paused (or not created yet: nothing was admitted under it).
    Open,
    /// Stopped or paused at the gate: what that asks of the trajectory (a cancel, a kill, a
    /// pause).
    Closed(Control),
    /// The gate could not say (unreachable, a refusal): no model call may start on a guess.
    Unknown(String),
}

impl GateConfig {
    /// Reads the run's fence with `status`, answered from the gate's durable state: a stop the
    /// gate acknowledged before this is seen, whatever its event's way to the runner.
    pub fn fence(&self, run: &str) -> Fence {
        let asked = (|| {
            let mut c = Client::connect_as(&self.target, &self.token)?;
            c.ask::<estop_protocol::server_line::RunView>(
                &op(Verb::Status, &json!({ "run": run }))
                    .map_err(estop_server::client::ClientError::Protocol)?,
            )
        })();
        match asked {
            Ok(v) => fence_of(&v),
            Err(e) if e.code() == Some(estop_protocol::ErrorCode::NotFound) => Fence::Open,
            Err(e) => Fence::Unknown(e.to_string()),
        }
    }
}

/// What a run view says of the fence: a stopped run (any cause, or a terminal or finalizing
/// state) is a kill when its cause says `killed`, else a cancel; a paused run a pause.
pub(crate) fn fence_of(v: &estop_protocol::server_line::RunView) -> Fence {
    let stopped = v.stopped_at.is_some()
        || v.cause.is_some()
        || matches!(
            v.state.as_str(),
            "finalizing" | "completed" | "failed" | "cancelled"
        );
    if stopped {
        let reason = v.reason.clone().unwrap_or_else(|| {
            format!(
                "stopped at the gate ({})",
                v.cause.as_deref().unwrap_or(&v.state)
            )
        });
        return Fence::Closed(match v.cause.as_deref() {
            Some("killed") => Control::Kill { reason },
            _ => Control::Cancel { reason },
        });
    }
    match v.state.as_str() {
        "paused" => Fence::Closed(Control::Pause),
        _ => Fence::Open,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use estop_protocol::server_line::RunView;

    /// Each run view the gate may answer `status` with, as the fence it is: any stop (by
    /// state or by cause) closes it, as a kill when the cause says so; a pause pauses.
    #[test]
    fn a_run_view_is_the_fence_its_stop_or_pause_says() {
        let view = |state: &str, cause: Option<&str>| RunView {
            run: "t".into(),
            state: state.into(),
            cause: cause.map(Into::into),
            reason: cause.map(|_| "op".to_string()),
            stopped_at: cause.map(|_| 1),
            ..RunView::default()
        };
        assert_eq!(fence_of(&view("active", None)), Fence::Open);
        assert_eq!(
            fence_of(&view("paused", None)),
            Fence::Closed(Control::Pause)
        );
        let cancel = Fence::Closed(Control::Cancel {
            reason: "op".into(),
        });
        assert_eq!(fence_of(&view("cancelled", Some("cancelled"))), cancel);
        assert_eq!(fence_of(&view("finalizing", Some("cancelled"))), cancel);
        assert_eq!(fence_of(&view("failed", Some("deadline"))), cancel);
        assert_eq!(
            fence_of(&view("cancelled", Some("killed"))),
            Fence::Closed(Control::Kill {
                reason: "op".into()
            })
        );
        // A stopped state without a cause recorded is still a stop.
        assert!(matches!(
            fence_of(&view("completed", None)),
            Fence::Closed(Control::Cancel { .. })
        ));
    }
}
