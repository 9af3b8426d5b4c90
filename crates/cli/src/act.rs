//! The commands that change something: `approve`/`reject`, the run stops and pauses, and the
//! token registry; each a typed request and its typed reply.

use crate::remote::{Ask, Conn, Failure, Session, build};
use crate::show::esc;
use estop_protocol::{Ack, DecideReply, TokenCreated, TokenRevoked, Verb};

/// `approve` or `reject` (`decision`) of one held effect.
pub fn decide(
    conn: &Conn,
    run: String,
    key: String,
    decision: &str,
    reason: Option<String>,
) -> Result<u8, Failure> {
    let ask = Ask::new(Verb::Decide)
        .text("run", run.clone())
        .text("key", key.clone())
        .text("decision", decision)
        .text_opt("reason", reason);
    let op = build(conn, &ask)?;
    let mut session = Session::open(conn)?;
    let d: DecideReply = session.ask(&op)?;
    let approvals = d
        .approvals
        .iter()
        .map(|a| esc(a))
        .collect::<Vec<_>>()
        .join(", ");
    let line = match esc(&d.status).as_ref() {
        "held" => format!(
            "recorded; {}/{} approvals so far ({approvals})",
            d.approvals.len(),
            d.quorum
        ),
        // A reject records no approver: say nothing rather than an empty list.
        status if d.approvals.is_empty() => format!("{status} ({} {})", esc(&run), esc(&key)),
        status => format!(
            "{status} ({} {}; approvers: {approvals})",
            esc(&run),
            esc(&key)
        ),
    };
    session.print(d, || println!("{line}"));
    Ok(0)
}

/// `estop compensate settle|retry|skip|effect`: the effect's status after the operator's word.
pub fn saga(conn: &Conn, ask: Ask) -> Result<u8, Failure> {
    let op = build(conn, &ask)?;
    let mut session = Session::open(conn)?;
    let a: Ack = session.ask(&op)?;
    let mut line = a
        .status
        .as_deref()
        .map_or("recorded".into(), esc)
        .into_owned();
    if let Some(n) = a.attempt.filter(|n| *n > 0) {
        line.push_str(&format!(" (attempt {n})"));
    }
    if let Some(at) = a.retry_at {
        line.push_str(&format!("; offered again from {at}"));
    }
    session.print(a, || println!("{line}"));
    Ok(0)
}

/// A request answered with the run's state and the runs it changed: cancel, kill, pause,
/// resume, close.
pub fn run_state(conn: &Conn, ask: Ask) -> Result<u8, Failure> {
    let op = build(conn, &ask)?;
    let mut session = Session::open(conn)?;
    let ack: Ack = session.ask(&op)?;
    let state = ack.state.as_deref().map_or("null".into(), esc);
    let runs = ack
        .runs
        .iter()
        .map(|r| esc(r))
        .collect::<Vec<_>>()
        .join(", ");
    let mut line = if runs.is_empty() {
        format!("run is {state} (nothing changed)")
    } else {
        format!("run is {state}; changed: {runs}")
    };
    // What the stop did not stop: each effect still in flight, an egress request by its
    // method and URL.
    let in_flight = ack.in_flight.as_deref().map_or(&[][..], |l| &l.0[..]);
    for f in in_flight {
        let what = f
            .args
            .as_ref()
            .and_then(|a| crate::read::request_line(&a.to_value()))
            .unwrap_or_else(|| esc(&f.tool).into_owned());
        line.push_str(&format!(
            "\n  in flight: {} {} {what}",
            esc(&f.run),
            esc(&f.key)
        ));
    }
    if in_flight.len() == estop_protocol::IN_FLIGHT_LISTED_MAX {
        line.push_str(&format!(
            "\n  (the first {}: `estop report RUN` lists every one)",
            estop_protocol::IN_FLIGHT_LISTED_MAX
        ));
    }
    session.print(ack, || println!("{line}"));
    Ok(0)
}

pub fn token_create(
    conn: &Conn,
    name: String,
    role: String,
    groups: &[String],
) -> Result<u8, Failure> {
    let ask = Ask::new(Verb::Token)
        .text("name", name.clone())
        .text("role", role)
        .groups(groups);
    let op = build(conn, &ask)?;
    let mut session = Session::open(conn)?;
    let t: TokenCreated = session.ask(&op)?;
    let (secret, role) = (t.token.expose().to_string(), t.role.clone());
    session.print(t, || {
        // The secret goes to stdout alone (for a script to capture); the note to stderr.
        println!("{secret}");
        eprintln!("created {role} token {name:?}; the secret above is shown only once");
    });
    Ok(0)
}

pub fn token_revoke(conn: &Conn, name: String) -> Result<u8, Failure> {
    let op = build(conn, &Ask::new(Verb::TokenRevoke).text("name", name))?;
    let mut session = Session::open(conn)?;
    let t: TokenRevoked = session.ask(&op)?;
    let line = format!("revoked {} token {}", esc(&t.role), esc(&t.name));
    session.print(t, || println!("{line}"));
    Ok(0)
}
