//! The commands that read the gate's state: `runs`, `pending`, `status` and `report`, each a
//! typed request and its typed reply printed as a table, lines, or JSON.

use crate::remote::{Ask, Conn, Failure, Session, build};
use crate::show::{cell, esc, now_ms, table, truncate};
use estop_protocol::{
    BudgetLine, EffectCounts, PendingReply, Report, ReportItem, RunView, RunsReply, SagaNext, Verb,
};

pub fn runs(conn: &Conn, state: Option<String>, limit: Option<u32>) -> Result<u8, Failure> {
    let ask = Ask::new(Verb::Runs).text_opt("state", state);
    build(conn, &ask)?;
    let mut session = Session::open(conn)?;
    let page: RunsReply = session.listing(&ask, limit)?;
    let rows: Vec<Vec<String>> = page.runs.iter().map(run_row).collect();
    session.print(page, || {
        table(
            &[
                "RUN",
                "STATE",
                "OWNER",
                "PARENT",
                "DONE/FLYING/HELD/REFUSED",
                "CAUSE",
                "REASON",
            ],
            &rows,
        );
    });
    Ok(0)
}

fn run_row(r: &RunView) -> Vec<String> {
    let e = &r.effects;
    vec![
        cell(&r.run),
        cell(&r.state),
        cell(&r.owner),
        r.parent.clone().unwrap_or_else(|| "-".into()),
        format!("{}/{}/{}/{}", e.completed, e.started, e.held, e.refused),
        r.cause.clone().unwrap_or_else(|| "-".into()),
        r.reason
            .as_deref()
            .map_or_else(|| "-".into(), |x| truncate(x, 40)),
    ]
}

pub fn pending(conn: &Conn, run: Option<String>, limit: Option<u32>) -> Result<u8, Failure> {
    let ask = Ask::new(Verb::Pending).text_opt("run", run);
    build(conn, &ask)?;
    let mut session = Session::open(conn)?;
    let page: PendingReply = session.listing(&ask, limit)?;
    let now = now_ms();
    let rows: Vec<Vec<String>> = page
        .pending
        .iter()
        .map(|p| {
            let left = p.expires_at.saturating_sub(now) / 1000;
            vec![
                cell(&p.run),
                cell(&p.key),
                match &p.compensates {
                    Some(forward) => format!("{} (undo of {})", cell(&p.tool), cell(forward)),
                    None => cell(&p.tool),
                },
                p.args.as_ref().map_or("(digest only)".into(), |a| {
                    truncate(&a.to_value().to_string(), 60)
                }),
                format!("{}/{}", p.approvals.len(), p.quorum),
                format!("{left}s"),
                cell(&p.digest).chars().take(12).collect(),
            ]
        })
        .collect();
    session.print(page, || {
        table(
            &[
                "RUN",
                "KEY",
                "TOOL",
                "ARGS",
                "QUORUM",
                "EXPIRES IN",
                "DIGEST",
            ],
            &rows,
        );
    });
    Ok(0)
}

pub fn status(conn: &Conn, run: String) -> Result<u8, Failure> {
    let op = build(conn, &Ask::new(Verb::Status).text("run", run))?;
    let mut session = Session::open(conn)?;
    let view: RunView = session.ask(&op)?;
    let lines = status_lines(&view);
    session.print(view, || {
        for (name, value) in lines {
            println!("{name:<12} {value}");
        }
    });
    Ok(0)
}

/// The lines of `status`: each field the reply has, then the effect counts.
fn status_lines(v: &RunView) -> Vec<(&'static str, String)> {
    let text = |name, value: Option<&String>| value.map(|x| (name, cell(x)));
    let number = |name, value: Option<u64>| value.map(|x| (name, x.to_string()));
    [
        text("run", Some(&v.run)),
        text("state", Some(&v.state)),
        text("owner", Some(&v.owner)),
        text("parent", v.parent.as_ref()),
        text("cause", v.cause.as_ref()),
        text("reason", v.reason.as_ref()),
        number("stopped_at", v.stopped_at),
        v.forgotten.then(|| ("forgotten", "true".to_string())),
        number("epoch", Some(v.epoch)),
        number("created_at", Some(v.created_at)),
        number("deadline_at", v.deadline_at),
        number("max_effects", v.max_effects),
        Some(("effects", counts(&v.effects))),
    ]
    .into_iter()
    .flatten()
    .chain(v.budget.iter().map(|b| ("budget", budget_cell(b))))
    .collect()
}

/// One dimension of the model budget, as `status` and `report` print it.
fn budget_cell(b: &BudgetLine) -> String {
    let limit = b.limit.map_or("none".into(), |l| l.to_string());
    format!(
        "{}  spent {}  reserved {}  limit {limit}",
        esc(&b.dimension),
        b.spent,
        b.reserved
    )
}

/// The counts as the JSON object they are on the wire, keys in order.
fn counts(e: &EffectCounts) -> String {
    format!(
        "{{\"admitted\":{},\"completed\":{},\"failed\":{},\"held\":{},\"refused\":{},\"started\":{},\"unknown\":{}}}",
        e.admitted, e.completed, e.failed, e.held, e.refused, e.started, e.unknown
    )
}

pub fn report(conn: &Conn, run: String) -> Result<u8, Failure> {
    let ask = Ask::new(Verb::Report).text("run", run);
    build(conn, &ask)?;
    let mut session = Session::open(conn)?;
    let r: Report = session.listing(&ask, None)?;
    let lines = report_lines(&r);
    session.print(r, || {
        for line in lines {
            println!("{line}");
        }
    });
    Ok(0)
}

/// The lists of a report, in the order they are printed.
fn sections(r: &Report) -> [(&'static str, &[ReportItem]); 9] {
    [
        ("done", &r.done),
        ("failed", &r.failed),
        ("refused", &r.refused),
        ("in_flight", &r.in_flight),
        ("unknown", &r.unknown),
        ("held", &r.held),
        ("compensable", &r.compensable),
        ("irreversible", &r.irreversible),
        ("undeclared", &r.undeclared),
    ]
}

fn report_lines(r: &Report) -> Vec<String> {
    let mut out = vec![format!(
        "run {}  state {}  cause {}",
        esc(&r.run),
        esc(&r.state),
        r.cause.as_deref().map_or("-".into(), esc)
    )];
    if let Some(reason) = &r.reason {
        out.push(format!("reason {}", esc(reason)));
    }
    if let Some(s) = &r.saga_next {
        out.push(saga_line(s));
    }
    // The model budget of the run's tree (docs/PROTOCOL.md, "Model budget").
    for b in &r.budget {
        out.push(format!("budget {}", budget_cell(b)));
    }
    if r.forgotten {
        let at = r.stopped_at.map_or("null".into(), |t| t.to_string());
        out.push(format!(
            "forgotten after retention (stopped at {at}): only its fence is kept, so every section is empty; `estop ledger show --run` has what the ledger still holds"
        ));
    }
    for (section, items) in sections(r) {
        out.push(format!("\n{section} ({})", items.len()));
        out.extend(items.iter().map(report_item));
    }
    out
}

fn report_item(i: &ReportItem) -> String {
    let mut line = format!(
        "  {:<24} {:<20} {}",
        esc(&i.key),
        esc(&i.tool),
        esc(&i.status)
    );
    if let Some(r) = &i.reason {
        line.push_str(&format!(" ({})", esc(r)));
    }
    if i.late {
        line.push_str(" [late]");
    }
    if let Some(c) = &i.compensate {
        line.push_str(&format!(" undo: {}", esc(c)));
    }
    if let Some(l) = &i.lookup {
        line.push_str(&format!(" lookup: {}", esc(l)));
    }
    if let Some(n) = i.lookups {
        line.push_str(&format!(" looked up {n}x"));
    }
    if i.chosen {
        line.push_str(" [asked for]");
    }
    if let Some(h) = &i.holder {
        line.push_str(&format!(" by: {}", esc(h)));
    }
    if let Some(n) = i.disputes {
        line.push_str(&format!(
            " [{n} contradicting completion{} refused]",
            if n == 1 { "" } else { "s" }
        ));
    }
    if let (Some(n), Some(max)) = (i.attempts, i.attempts_max) {
        line.push_str(&format!(" attempts {n}/{max}"));
    }
    if let Some(at) = i.retry_at {
        line.push_str(&format!(" retry at {at}"));
    }
    if let Some(note) = &i.note {
        line.push_str(&format!(" note: {}", esc(note)));
    }
    if let Some(by) = &i.by {
        line.push_str(&format!(" by {}", esc(by)));
    }
    line.push_str(&egress_text(i));
    line
}

/// An egress effect's request (method and URL, or the model and its host), the response's
/// status and size, and its error, as the report line's tail.
fn egress_text(i: &ReportItem) -> String {
    let mut out = String::new();
    if let Some(req) = i.args.as_ref().and_then(|a| request_line(&a.to_value())) {
        out.push_str(&format!("\n      {req}"));
    }
    if let Some(s) = i.http_status {
        out.push_str(&format!(" -> {s}"));
    }
    if let Some(b) = i.bytes {
        out.push_str(&format!(" ({b} bytes)"));
    }
    if let Some(e) = &i.error {
        out.push_str(&format!(" error: {}", esc(e)));
    }
    out
}

/// What an egress effect's recorded arguments say it reached: `METHOD URL` for an HTTP
/// request, `model MODEL at HOST` for a model call; escaped for a terminal.
pub fn request_line(args: &serde_json::Value) -> Option<String> {
    if let (Some(m), Some(u)) = (args["method"].as_str(), args["url"].as_str()) {
        return Some(format!("{} {}", esc(m), esc(u)));
    }
    let host = args["host"].as_str()?;
    let model = args["model"].as_str().unwrap_or("?");
    Some(format!("model {} at {}", esc(model), esc(host)))
}

/// What the reverse saga waits for, said for an operator.
fn saga_line(s: &SagaNext) -> String {
    let key = esc(&s.key);
    let what = match s.waits.as_str() {
        "outcome" => format!(
            "{key} to finish (in flight; if its agent is gone: `estop compensate settle RUN {key} \
             --outcome ok|error|unknown`)"
        ),
        "settle" => format!(
            "{key}'s unknown outcome: `estop compensate settle RUN {key} --outcome ok|error`"
        ),
        "lookup" => format!(
            "an executor (`compensations`) to run lookup {} of {key}'s unknown outcome",
            s.attempt.unwrap_or(1)
        ),
        "looking_up" => format!(
            "lookup {} of {key}'s unknown outcome to be reported",
            s.attempt.unwrap_or(1)
        ),
        "executor" => format!(
            "an executor (`compensations`) to run attempt {} of {key}'s undo{}",
            s.attempt.unwrap_or(1),
            s.at.filter(|at| *at > 0)
                .map_or(String::new(), |at| format!(" from {at}"))
        ),
        "running" => format!(
            "attempt {} of {key}'s undo to be reported",
            s.attempt.unwrap_or(1)
        ),
        "human" => format!("an operator: `estop compensate retry|skip RUN {key}`"),
        "approval" => format!(
            "approval {} of {key}'s undo (a policy rule holds the compensating call): \
             `estop approve|reject RUN {key}`, by as many operators as its quorum{}",
            s.approval.as_deref().map_or("?".into(), esc),
            s.at.map_or(String::new(), |at| format!("; expires at {at}"))
        ),
        other => format!("{} on {key}", esc(other)),
    };
    format!("saga waits for {what}")
}
