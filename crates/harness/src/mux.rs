//! One asynchronous connection to the gate for every trajectory's event subscription and
//! approval wait, instead of a blocking thread (and a connection) each: requests go out
//! pipelined with their ids and replies are matched back by id; events are routed by run.
//!
//! An approval wait holds no request open: the run's subscription says when its held calls
//! may have moved (a decision, an expiry, a stop, a resume), and only then is each asked about
//! with a `wait` of 0 ms, which answers at once. So 10,000 trajectories waiting for a human
//! cost 10,000 entries in a map and nothing in flight at the gate.

use crate::gate::{GateConfig, control_of, decision_of, op};
use crate::record::Decision;
use crate::runner::Input;
use estop_protocol::server_line::{ServerLine, parse_server_line};
use estop_protocol::{Event, EventKind, Id, Op, ReplyBody, Secret, Verb};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::{Semaphore, mpsc, oneshot};

/// Requests in flight on the connection at once: under the gate's
/// `outstanding_per_connection_max` (1024), so the gate never refuses one for that.
const OUTSTANDING_MAX: usize = 1000;
/// Longest line the gate may send.
const LINE_BYTES_MAX: usize = 1 << 20;

type Waiting = HashMap<u64, (Verb, oneshot::Sender<Result<ReplyBody, String>>)>;

/// The connection: cheap to clone; closes when the gate goes (every request then fails).
#[derive(Clone)]
pub struct Mux {
    out: mpsc::UnboundedSender<Vec<u8>>,
    next_id: Arc<AtomicU64>,
    waiting: Arc<Mutex<Waiting>>,
    slots: Arc<Semaphore>,
}

impl Mux {
    /// Connects, authenticates, and returns the connection and the stream of its events.
    pub async fn connect(
        gate: &GateConfig,
    ) -> Result<(Mux, mpsc::UnboundedReceiver<Event>), String> {
        let t = &gate.target;
        let (r, w): (
            Box<dyn AsyncRead + Send + Unpin>,
            Box<dyn AsyncWrite + Send + Unpin>,
        ) = if t.contains('/') || std::path::Path::new(t).exists() {
            let (r, w) = tokio::net::UnixStream::connect(t)
                .await
                .map_err(|e| format!("cannot connect to {t}: {e}"))?
                .into_split();
            (Box::new(r), Box::new(w))
        } else {
            let (r, w) = tokio::net::TcpStream::connect(t)
                .await
                .map_err(|e| format!("cannot connect to {t}: {e}"))?
                .into_split();
            (Box::new(r), Box::new(w))
        };
        let (out, lines) = mpsc::unbounded_channel();
        let (events_tx, events) = mpsc::unbounded_channel();
        let waiting = Arc::new(Mutex::new(Waiting::new()));
        tokio::spawn(write_lines(w, lines));
        tokio::spawn(read_lines(r, waiting.clone(), events_tx));
        let mux = Mux {
            out,
            next_id: Arc::new(AtomicU64::new(1)),
            waiting,
            slots: Arc::new(Semaphore::new(OUTSTANDING_MAX)),
        };
        mux.request(Op::Hello {
            token: Secret::new(&gate.token),
            run: None,
            component: Default::default(),
        })
        .await?;
        Ok((mux, events))
    }

    /// Sends `op` and waits for its reply; a refusal or a closed connection is an error.
    pub async fn request(&self, op: Op) -> Result<ReplyBody, String> {
        let _slot = self.slots.acquire().await.map_err(|e| e.to_string())?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.waiting).insert(id, (op.verb(), tx));
        if self.out.send(op.to_line(&Id::from_u64(id))).is_err() {
            lock(&self.waiting).remove(&id);
            return Err("the connection to the gate is closed".into());
        }
        rx.await
            .unwrap_or_else(|_| Err("the connection to the gate is closed".into()))
    }
}

fn lock(w: &Mutex<Waiting>) -> std::sync::MutexGuard<'_, Waiting> {
    w.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn write_lines(
    mut w: Box<dyn AsyncWrite + Send + Unpin>,
    mut lines: mpsc::UnboundedReceiver<Vec<u8>>,
) {
    while let Some(line) = lines.recv().await {
        if w.write_all(&line).await.is_err() {
            return;
        }
    }
}

/// Replies to their requests by id, events to the event stream; when the connection ends,
/// every request still waiting fails.
async fn read_lines(
    r: Box<dyn AsyncRead + Send + Unpin>,
    waiting: Arc<Mutex<Waiting>>,
    events: mpsc::UnboundedSender<Event>,
) {
    let mut r = BufReader::new(r);
    let mut line = Vec::new();
    loop {
        line.clear();
        let read = tokio::io::AsyncReadExt::take(&mut r, LINE_BYTES_MAX as u64)
            .read_until(b'\n', &mut line)
            .await;
        if !matches!(read, Ok(n) if n > 0 && line.ends_with(b"\n")) {
            break;
        }
        let Ok(parsed) = parse_server_line(&line[..line.len() - 1]) else {
            break;
        };
        match parsed {
            ServerLine::Event(e) => {
                let _ = events.send(e);
            }
            ServerLine::Reply(reply) => {
                // A reply without an id says why the gate closes the connection.
                let Some(id) = reply.id.as_u64() else { break };
                let Some((verb, to)) = lock(&waiting).remove(&id) else {
                    continue;
                };
                let answer = match (&reply.error, reply.ok) {
                    (_, true) => ReplyBody::decode(verb, &reply).map_err(|e| e.to_string()),
                    (Some(e), false) => Err(format!("{}: {}", e.code, e.message)),
                    (None, false) => Err(format!("a refusal without an error: {}", reply.raw)),
                };
                let _ = to.send(answer);
            }
        }
    }
    lock(&waiting).clear();
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
    let mut conn: Option<(Mux, mpsc::UnboundedReceiver<Event>)> = None;
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
                Some(e) => on_event(&conn.as_ref().expect("connected").0, e, &held, &watched, &runner, &polled_tx),
                None => {
                    // The gate went away: every held call waited for is a refusal.
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
