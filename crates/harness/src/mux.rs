//! One asynchronous connection to the gate for every trajectory's event subscription and
//! approval wait, instead of a blocking thread (and a connection) each: the one client's
//! tokio driver (`estop_client::Connection`), requests pipelined with their ids and replies
//! matched back by id; events are routed by run.
//!
//! An approval wait holds no request open: the run's subscription says when its held calls
//! may have moved (a decision, an expiry, a stop, a resume), and only then is each asked about
//! with a `wait` of 0 ms, which answers at once. So 10,000 trajectories waiting for a human
//! cost 10,000 entries in a map and nothing in flight at the gate.
//!
//! The connection survives the gate: after a restart or an idle close the client connects
//! again, says hello and subscribes again to every run; each run's `subscribe` answer is then
//! followed here by a `status` of the run (a stop or pause made while away becomes the control
//! request it would have been) and a poll of each of its held calls (a decision made while away
//! is heard).

use crate::gate::{GateConfig, control_of, decision_of, op};
use crate::record::Decision;
use crate::runner::Input;
use estop_client::{ClientError, Connection, Notice, Options};
use estop_protocol::server_line::RunReplay;
use estop_protocol::{Event, EventKind, Op, ReplyBody, Secret, Verb};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};
use tokio::sync::mpsc;

/// The connection to the gate; cheap to clone.
#[derive(Clone, Debug)]
pub struct Mux {
    conn: Connection,
}

impl Mux {
    /// Connects, authenticates, and returns the connection and the stream of its notices.
    pub async fn connect(
        gate: &GateConfig,
    ) -> Result<(Mux, mpsc::UnboundedReceiver<Notice>), String> {
        let hello = Op::Hello {
            token: Secret::new(&gate.token),
            run: None,
            component: Default::default(),
        };
        let (conn, notices, _) = Connection::connect(Options::new(&gate.target), hello)
            .await
            .map_err(|e| e.to_string())?;
        Ok((Mux { conn }, notices))
    }

    /// Sends `op` and waits for its reply; a refusal or a gate away too long is an error.
    pub async fn request(&self, op: Op) -> Result<ReplyBody, String> {
        self.conn
            .request(op)
            .await
            .map_err(|e: ClientError| e.to_string())
    }
}

/// What the runner asks of the gate task.
#[derive(Debug)]
pub enum GateAsk {
    /// Subscribe to the run: its stops, pauses and resumes come back as control requests.
    Watch { run: String },
    /// Tell the runner when the held effect `key` of `run` is decided, as the decision of the
    /// call `call` of the trajectory `trajectory` (the same run and key for a held tool call;
    /// an HTTP tool's held request is the effect `idem:CALL_ID` of the call's run
    /// `TRAJECTORY/CALL_ID`, whose events are subscribed to first).
    Decision {
        run: String,
        key: String,
        trajectory: String,
        call: String,
    },
}

/// Who a held effect's decision goes to: the trajectory and its call.
type Held = BTreeMap<String, BTreeMap<String, (String, String)>>;

/// What a poll of a held call found, back to the gate task.
enum Polled {
    Decided(String, String, Decision),
    /// Still held; its approval request as the inbox shows it, when found there.
    Still(Option<Shown>),
}

/// A held call's approval request: run, key, approval id, quorum, approvers so far.
struct Shown {
    run: String,
    key: String,
    approval: String,
    quorum: u32,
    approvers: Vec<String>,
}

/// The gate task: owns the connection (made on first use, again after it closed), the
/// subscriptions and the held calls waited for; hands controls and decisions to the runner.
pub async fn gate_task(
    gate: GateConfig,
    mut asks: mpsc::UnboundedReceiver<GateAsk>,
    runner: mpsc::UnboundedSender<Input>,
) {
    let mut conn: Option<(Mux, mpsc::UnboundedReceiver<Notice>)> = None;
    // Held effects waited for, by run and key.
    let mut held: Held = BTreeMap::new();
    // The trajectories' runs: only their events are control requests (a held request's run
    // is subscribed to for its decision only).
    let mut watched: BTreeSet<String> = BTreeSet::new();
    let (polled_tx, mut polled) = mpsc::unbounded_channel::<Polled>();
    loop {
        let event = async {
            match conn.as_mut() {
                Some((_, ev)) => ev.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            ask = asks.recv() => {
                let Some(ask) = ask else { return };
                if conn.is_none() {
                    conn = Mux::connect(&gate).await.ok();
                }
                let (run, key) = match ask {
                    GateAsk::Watch { run } => {
                        watched.insert(run.clone());
                        (run, None)
                    }
                    GateAsk::Decision { run, key, trajectory, call } => (run, Some((key, trajectory, call))),
                };
                let Some((mux, _)) = &conn else {
                    // The gate cannot be reached: silence is no.
                    if let Some((_, trajectory, call)) = key {
                        let _ = runner.send(Input::Decided { id: trajectory, call, decision: Decision::Canceled });
                    }
                    continue;
                };
                match key {
                    None => {
                        let (mux, run) = (mux.clone(), run.clone());
                        tokio::spawn(async move { mux.request(op(Verb::Subscribe, &json!({"run": run}))?).await });
                    }
                    Some((key, trajectory, call)) => {
                        let own = run == trajectory;
                        held.entry(run.clone()).or_default().insert(key.clone(), (trajectory, call));
                        let (mux, polled) = (mux.clone(), polled_tx.clone());
                        tokio::spawn(async move {
                            // Another run's effect: its events are subscribed to before the
                            // first poll, so no decision falls between the two.
                            // A subscription refused (a share of the gate's reached) would
                            // leave the decision unheard: silence is no.
                            if !own {
                                let sub = op(Verb::Subscribe, &json!({"run": run}));
                                let subscribed = match sub {
                                    Ok(sub) => mux.request(sub).await.is_ok(),
                                    Err(_) => false,
                                };
                                if !subscribed {
                                    let _ = polled.send(Polled::Decided(run, key, Decision::Canceled));
                                    return;
                                }
                            }
                            poll(mux, run, key, polled).await;
                        });
                    }
                }
            }
            e = event => match e {
                Some(Notice::Event(e)) => on_event(&conn.as_ref().expect("connected").0, e, &held, &watched, &runner, &polled_tx),
                // Subscribed again after the gate came back: what happened while away.
                Some(Notice::Restored { op: Op::Subscribe { run }, result }) => {
                    let replay = match result {
                        Ok(ReplyBody::Subscribed(r)) => r.replay,
                        _ => None,
                    };
                    resync(&conn.as_ref().expect("connected").0, run.to_string(), replay, &held, &watched, &runner, &polled_tx);
                }
                Some(Notice::Reconnected(_) | Notice::Disconnected { .. } | Notice::Restored { .. }) => {}
                Some(Notice::Dead(_)) | None => {
                    // The gate no longer takes the token: every held call waited for is a
                    // refusal (silence is no).
                    conn = None;
                    for keys in std::mem::take(&mut held).into_values() {
                        for (trajectory, call) in keys.into_values() {
                            let _ = runner.send(Input::Decided { id: trajectory, call, decision: Decision::Canceled });
                        }
                    }
                }
            },
            Some(p) = polled.recv() => {
                if let Polled::Still(Some(q)) = p {
                    if let Some((trajectory, call)) = held.get(&q.run).and_then(|k| k.get(&q.key)) {
                        let _ = runner.send(Input::Quorum {
                            id: trajectory.clone(),
                            call: call.clone(),
                            approval: q.approval,
                            quorum: q.quorum,
                            approvers: q.approvers,
                        });
                    }
                } else if let Polled::Decided(run, key, decision) = p {
                    let known = held.get_mut(&run).and_then(|k| k.remove(&key));
                    if held.get(&run).is_some_and(BTreeMap::is_empty) {
                        held.remove(&run);
                        // A held request's run, followed only for its decision: its
                        // subscription goes, so a runner's subscriptions stay one per
                        // trajectory plus one per request waited for.
                        if !watched.contains(&run) && let Some((mux, _)) = &conn {
                            let mux = mux.clone();
                            tokio::spawn(async move {
                                mux.request(op(Verb::Unsubscribe, &json!({"run": run}))?).await
                            });
                        }
                    }
                    if let Some((trajectory, call)) = known {
                        let _ = runner.send(Input::Decided { id: trajectory, call, decision });
                    }
                }
            }
        }
    }
}

/// An event of a run: a stop, pause or resume is a control request; whatever it is, the run's
/// held calls may have moved, so each is asked about again.
fn on_event(
    mux: &Mux,
    e: Event,
    held: &Held,
    watched: &BTreeSet<String>,
    runner: &mpsc::UnboundedSender<Input>,
    polled: &mpsc::UnboundedSender<Polled>,
) {
    for key in held.get(&e.run).into_iter().flat_map(BTreeMap::keys) {
        tokio::spawn(poll(
            mux.clone(),
            e.run.clone(),
            key.clone(),
            polled.clone(),
        ));
    }
    if !watched.contains(&e.run)
        || !matches!(
            e.event,
            EventKind::Cancelled | EventKind::Finalizing | EventKind::Paused | EventKind::Resumed
        )
    {
        return;
    }
    let (mux, runner) = (mux.clone(), runner.clone());
    tokio::spawn(async move {
        let stop = matches!(e.event, EventKind::Cancelled | EventKind::Finalizing);
        let killed = stop && killed(&mux, &e.run).await;
        if let Some(control) = control_of(&e, killed) {
            let _ = runner.send(Input::Control { id: e.run, control });
        }
    });
}

/// After a new connection subscribed to `run` again: each of its held calls is asked about
/// again (a decision made while away), and a trajectory's run is looked at — in the
/// subscription's replay of its durable state, or with a `status` when the gate sent none —
/// so a stop or pause made while away becomes its control request and a resume made while
/// away lifts the pause.
fn resync(
    mux: &Mux,
    run: String,
    replay: Option<RunReplay>,
    held: &Held,
    watched: &BTreeSet<String>,
    runner: &mpsc::UnboundedSender<Input>,
    polled: &mpsc::UnboundedSender<Polled>,
) {
    for key in held.get(&run).into_iter().flat_map(BTreeMap::keys) {
        tokio::spawn(poll(mux.clone(), run.clone(), key.clone(), polled.clone()));
    }
    if !watched.contains(&run) {
        return;
    }
    if let Some(r) = replay {
        if let Some(control) = control_of_state(&r.state, r.cause.as_deref(), r.reason) {
            let _ = runner.send(Input::Control { id: run, control });
        }
        return;
    }
    let (mux, runner) = (mux.clone(), runner.clone());
    tokio::spawn(async move {
        let Ok(status) = op(Verb::Status, &json!({"run": run})) else {
            return;
        };
        let Ok(ReplyBody::Status(v)) = mux.request(status).await else {
            return;
        };
        if let Some(control) = control_of_state(&v.state, v.cause.as_deref(), v.reason.clone()) {
            let _ = runner.send(Input::Control { id: run, control });
        }
    });
}

/// The control request a run's state asks of its trajectory, read after a reconnect.
fn control_of_state(
    state: &str,
    cause: Option<&str>,
    reason: Option<String>,
) -> Option<crate::record::Control> {
    use crate::record::Control;
    let reason = || {
        reason
            .clone()
            .unwrap_or_else(|| "stopped at the gate".into())
    };
    let stopped = matches!(state, "cancelled" | "finalizing");
    Some(match cause {
        Some("killed") if stopped => Control::Kill { reason: reason() },
        Some("cancelled" | "deadline" | "budget") if stopped => {
            Control::Cancel { reason: reason() }
        }
        _ if state == "paused" => Control::Pause,
        _ if state == "active" => Control::Resume,
        _ => return None,
    })
}

/// A kill is a cancel on the wire; the run's stop cause tells them apart.
async fn killed(mux: &Mux, run: &str) -> bool {
    let Ok(status) = op(Verb::Status, &json!({"run": run})) else {
        return false;
    };
    matches!(mux.request(status).await, Ok(ReplyBody::Status(v)) if v.cause.as_deref() == Some("killed"))
}

/// The approval request of a call still held, from the gate's inbox (`pending` of its run):
/// its id, quorum and approvers so far; `None` when not listed (a sibling or pause hold).
async fn shown(mux: &Mux, run: String, key: String) -> Option<Shown> {
    let asked = op(Verb::Pending, &json!({"run": run})).ok()?;
    let Ok(ReplyBody::Pending(p)) = mux.request(asked).await else {
        return None;
    };
    let item = p
        .pending
        .into_iter()
        .find(|i| i.run == run && i.key == key)?;
    Some(Shown {
        run,
        key,
        approval: item.approval,
        quorum: item.quorum,
        approvers: item.approvals,
    })
}

/// Asks about one held call with a `wait` that answers at once.
async fn poll(mux: Mux, run: String, key: String, to: mpsc::UnboundedSender<Polled>) {
    let asked = op(
        Verb::Wait,
        &json!({"run": run, "key": key, "timeout_ms": 0}),
    );
    let polled = match asked {
        Ok(o) => match mux.request(o).await {
            Ok(ReplyBody::VerdictReply(v)) => match decision_of(v) {
                Some(d) => Polled::Decided(run, key, d),
                None => Polled::Still(shown(&mux, run, key).await),
            },
            _ => Polled::Decided(run, key, Decision::Canceled),
        },
        Err(_) => Polled::Decided(run, key, Decision::Canceled),
    };
    let _ = to.send(polled);
}
