//! `/metrics` in the Prometheus text format (version 0.0.4): the core's counters and gauges
//! (`CoreMsg::Stats`), the ledger's group-commit histograms, connections and console sessions.
//! The names and what each means are in docs/HTTP.md.

use crate::app::{App, error};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use estop_ledger::HistogramSnapshot;
use estop_protocol::ErrorCode;
use estop_server::core::CoreMsg;
use estop_server::durable;
use std::fmt::Write as _;
use std::sync::atomic::Ordering;

struct Out(String);

impl Out {
    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        self.0.push_str(name);
        if !labels.is_empty() {
            self.0.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.0.push(',');
                }
                let _ = write!(self.0, "{k}=\"{}\"", escape(v));
            }
            self.0.push('}');
        }
        let _ = writeln!(self.0, " {value}");
    }

    /// A histogram whose bounds are in `unit`s of a second (1e-6 for µs, 1e-3 for ms, 1.0 for a
    /// plain count when `unit` is `None`).
    fn histogram(
        &mut self,
        name: &str,
        labels: &[(&str, &str)],
        h: &HistogramSnapshot,
        unit: Option<f64>,
    ) {
        let scale = |v: u64| unit.map_or(v as f64, |u| v as f64 * u);
        let mut cumulative = 0;
        for (bound, count) in h.bounds.iter().zip(&h.counts) {
            cumulative += count;
            let le = format!("{}", scale(*bound));
            let mut l = labels.to_vec();
            l.push(("le", &le));
            self.sample(&format!("{name}_bucket"), &l, cumulative);
        }
        let mut l = labels.to_vec();
        l.push(("le", "+Inf"));
        self.sample(&format!("{name}_bucket"), &l, h.count());
        self.sample(&format!("{name}_sum"), labels, scale(h.sum));
        self.sample(&format!("{name}_count"), labels, h.count());
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

pub async fn render(app: &App) -> Response {
    let (tx, rx) = tokio::sync::oneshot::channel();
    if app
        .shared
        .core_tx
        .send(CoreMsg::Stats { reply: tx })
        .is_err()
    {
        return error(ErrorCode::Unavailable, "the gate is shutting down");
    }
    let Ok(s) = rx.await else {
        return error(ErrorCode::Unavailable, "the gate is shutting down");
    };
    // The gauges may count changes not yet durable: show them once they are (G6).
    let mut durable_rx = app.shared.durable_rx.clone();
    let _ = durable::wait(&mut durable_rx, s.after).await;
    let mut o = Out(String::with_capacity(8192));

    o.head(
        "estop_admissions_total",
        "counter",
        "Verdicts the gate answered to admit, wait and start, by verdict and reason.",
    );
    for (verdict, reason, n) in &s.verdicts {
        o.sample(
            "estop_admissions_total",
            &[("verdict", verdict), ("reason", reason)],
            n,
        );
    }
    o.head(
        "estop_approvals_pending",
        "gauge",
        "Effects held for an operator's decision now, and compensating calls held for approval.",
    );
    o.sample("estop_approvals_pending", &[], s.approvals_pending);
    o.head(
        "estop_approval_decision_seconds",
        "histogram",
        "Time from an effect's hold to the decision that ended it (quorum reached, or a reject).",
    );
    for (decision, h) in &s.decisions {
        o.histogram(
            "estop_approval_decision_seconds",
            &[("decision", decision)],
            h,
            Some(1e-3),
        );
    }
    o.head(
        "estop_approvals_expired_total",
        "counter",
        "Approvals that expired undecided (silence is no).",
    );
    o.sample("estop_approvals_expired_total", &[], s.approvals_expired);
    o.head(
        "estop_snapshot_failures_total",
        "counter",
        "Snapshots that failed (each retried with backoff; the daemon's log says why).",
    );
    o.sample("estop_snapshot_failures_total", &[], s.snapshot_failures);
    o.head("estop_runs", "gauge", "Runs the gate holds, by state.");
    for (state, n) in &s.runs_by_state {
        o.sample("estop_runs", &[("state", state)], n);
    }
    o.head(
        "estop_effects_in_flight",
        "gauge",
        "Effects started and not yet completed.",
    );
    o.sample("estop_effects_in_flight", &[], s.effects_in_flight);
    o.head(
        "estop_effects_held",
        "gauge",
        "Effects held (for approval, behind a sibling or a pause) or approved and not yet consumed (bound: --held-max).",
    );
    o.sample("estop_effects_held", &[], s.effects_held);
    o.head(
        "estop_tombstones",
        "gauge",
        "Fences of forgotten runs (bound: --tombstones-max; at it, stopped runs are kept whole).",
    );
    o.sample("estop_tombstones", &[], s.tombstones);
    o.head(
        "estop_waiters",
        "gauge",
        "Agents blocked in wait for a decision.",
    );
    o.sample("estop_waiters", &[], s.waiters);

    let sync = &app.ctx.sync_stats;
    o.head(
        "estop_ledger_fsync_seconds",
        "histogram",
        "fdatasync latency of each group commit.",
    );
    o.histogram(
        "estop_ledger_fsync_seconds",
        &[],
        &sync.sync_us.snapshot(),
        Some(1e-6),
    );
    o.head(
        "estop_ledger_batch_records",
        "histogram",
        "Records per group commit (one fdatasync each).",
    );
    o.histogram(
        "estop_ledger_batch_records",
        &[],
        &sync.batch_records.snapshot(),
        None,
    );
    o.head(
        "estop_ledger_written_bytes_total",
        "counter",
        "Bytes the ledger wrote in group commits.",
    );
    o.sample(
        "estop_ledger_written_bytes_total",
        &[],
        sync.bytes.load(Ordering::Relaxed),
    );
    o.head(
        "estop_ledger_seq",
        "gauge",
        "Sequence number of the last ledger record appended.",
    );
    o.sample("estop_ledger_seq", &[], s.ledger_seq);

    o.head(
        "estop_connections",
        "gauge",
        "Open connections, by listener (protocol: v1; console: HTTP).",
    );
    o.sample(
        "estop_connections",
        &[("listener", "protocol")],
        app.ctx.connections.open(),
    );
    o.sample(
        "estop_connections",
        &[("listener", "console")],
        app.conns.open(),
    );
    o.head(
        "estop_connections_max",
        "gauge",
        "Connection limit, by listener.",
    );
    o.sample(
        "estop_connections_max",
        &[("listener", "protocol")],
        app.ctx.connections_max,
    );
    o.sample(
        "estop_connections_max",
        &[("listener", "console")],
        app.conns.max,
    );
    o.head(
        "estop_console_sessions",
        "gauge",
        "Live console login sessions.",
    );
    o.sample("estop_console_sessions", &[], app.auth.session_count());
    o.head(
        "estop_console_event_streams",
        "gauge",
        "Open server-sent-event streams.",
    );
    o.sample("estop_console_event_streams", &[], app.streams.open());
    let mut r = o.0.into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    r
}
