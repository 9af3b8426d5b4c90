//! Drives the kernel from tiny text scripts and renders replies and state as text, so kernel
//! tests read as data (`check(script, expect)`). Every script is also replayed from its encoded
//! ledger records and from a snapshot, which must reproduce the same state exactly.

#![allow(dead_code)]

use estop_kernel::record_codec::{
    RecordDecoder, decode_record, decode_snapshot, encode_record, encode_snapshot,
};
use estop_kernel::reply::{DecideStatus, Decided, Reply, Verdict};
use estop_kernel::state::Status;
use estop_kernel::vocab::{Decision, EffectClass, Outcome, PolicyAction, Reversibility};
use estop_kernel::{
    Admit, Command, Digest, EffectKey, Gate, Limits, PolicyDecision, Principal, PrincipalName,
    Record, Role, RunId, RunLimits, SagaAction, SagaStep, Spend, Token, TokenAction, TokenChange,
    ToolName,
};

/// `U/T`: micro-USD and tokens (`reserve=`, `cost=` in scripts).
fn spend_of(s: Option<&str>) -> Spend {
    s.map_or(Spend::default(), |s| {
        let (u, t) = s.split_once('/').expect("spend is U/T");
        Spend {
            usd_micros: u.parse().unwrap(),
            tokens: t.parse().unwrap(),
        }
    })
}
use std::fmt::Write;

/// `NAME` or `NAME+PART` (`agent+egress`: the agent's egress part).
pub fn principal(name: &str) -> Principal {
    let (name, part) = match name.split_once('+') {
        Some((n, p)) => (n, estop_kernel::Part::parse(p).expect("part")),
        None => (name, estop_kernel::Part::Main),
    };
    let (role, groups): (Role, &[&str]) = match name {
        "agent" | "agent2" => (Role::Agent, &[]),
        "alice" => (Role::Operator, &[]),
        "bob" => (Role::Operator, &["ops"]),
        "carol" => (Role::Operator, &["finance"]),
        "dave" => (Role::Operator, &["finance", "ops"]),
        "olive" => (Role::Observer, &[]),
        "xena" => (Role::Executor, &[]),
        other => panic!("unknown principal {other}"),
    };
    Principal {
        name: PrincipalName::new(name).unwrap(),
        role,
        groups: groups.iter().map(|g| (*g).into()).collect(),
        part,
    }
}

/// A stand-in digest: the call text, zero-padded (collision-free for short test strings).
pub fn digest(tool: &str, arg: &str) -> Digest {
    let text = format!("{tool}:{arg}");
    let mut d = [0u8; 32];
    for (i, b) in text.bytes().take(32).enumerate() {
        d[i] = b;
    }
    Digest(d)
}

pub fn policy(action: PolicyAction) -> PolicyDecision {
    PolicyDecision {
        action,
        class: EffectClass::Write,
        reversibility: Reversibility::Undeclared,
        compensate: None,
        compensate_args: None,
        lookup: None,
        lookup_args: None,
        quorum: 1,
        groups: vec![],
        expiry_ms: 1000,
        rule: "test".into(),
    }
}

/// Parses one script line `T WHO VERB ARGS...` into a record.
pub fn parse_line(line: &str, last_token: Option<Token>) -> Record {
    let words: Vec<&str> = line.split_whitespace().collect();
    let at: u64 = words[0].trim_start_matches('@').parse().expect("time");
    let principal = principal(words[1]);
    let verb = words[2];
    let pos: Vec<&str> = words[3..]
        .iter()
        .copied()
        .filter(|w| !w.contains('='))
        .collect();
    let opt = |name: &str| {
        words[3..]
            .iter()
            .find_map(|w| w.strip_prefix(&format!("{name}=")))
    };
    let run = || RunId::new(pos[0]).unwrap();
    let key = || EffectKey::new(pos[1]).unwrap();
    let token = |i: usize| match pos.get(i) {
        None | Some(&"last") => last_token.unwrap_or(Token {
            epoch: 1,
            serial: 1,
        }),
        Some(t) => Token::parse(t).expect("token"),
    };
    let command = match verb {
        "admit" => {
            let tool = pos[2];
            let arg = opt("arg").unwrap_or("");
            let mut p = policy(
                opt("action").map_or(PolicyAction::Allow, |a| PolicyAction::parse(a).unwrap()),
            );
            if let Some(c) = opt("class") {
                p.class = EffectClass::parse(c).unwrap();
            }
            if let Some(q) = opt("quorum") {
                p.quorum = q.parse().unwrap();
            }
            if let Some(g) = opt("groups") {
                p.groups = g.split(',').map(Into::into).collect();
            }
            if let Some(e) = opt("expiry") {
                p.expiry_ms = e.parse().unwrap();
            }
            if let Some(r) = opt("rev") {
                p.reversibility = Reversibility::parse(r).unwrap();
            }
            if let Some(c) = opt("comp") {
                p.compensate = Some(ToolName::new(c).unwrap());
                p.reversibility = Reversibility::Compensable;
            }
            if let Some(m) = opt("cargs") {
                p.compensate_args = Some(m.into());
            }
            if let Some(l) = opt("lookup") {
                p.lookup = Some(ToolName::new(l).unwrap());
            }
            if let Some(m) = opt("largs") {
                p.lookup_args = Some(m.into());
            }
            Command::Admit(Admit {
                run: run(),
                key: key(),
                tool: ToolName::new(tool).unwrap(),
                digest: digest(tool, arg),
                args: Some(format!("{{\"arg\":\"{arg}\"}}").into()),
                start: opt("start") != Some("false"),
                parent: opt("parent").map(|p| RunId::new(p).unwrap()),
                labels: vec![],
                limits: RunLimits {
                    deadline_at: opt("deadline").map(|d| d.parse().unwrap()),
                    max_effects: opt("max").map(|d| d.parse().unwrap()),
                    max_spend: opt("max_usd").map(|d| d.parse().unwrap()),
                    max_tokens: opt("max_tokens").map(|d| d.parse().unwrap()),
                },
                policy: Box::new(p),
                reserve: spend_of(opt("reserve")),
            })
        }
        "wait" => Command::Recheck {
            run: run(),
            key: key(),
        },
        "start" => Command::Start {
            run: run(),
            key: key(),
            token: token(2),
        },
        "complete" => {
            let outcome = pos
                .iter()
                .find_map(|w| Outcome::parse(w))
                .unwrap_or(Outcome::Ok);
            let tok = pos
                .get(2)
                .and_then(|t| Token::parse(t))
                .or(last_token)
                .unwrap_or(Token {
                    epoch: 1,
                    serial: 1,
                });
            Command::Complete {
                run: run(),
                key: key(),
                token: tok,
                outcome,
                result: opt("result").map(Into::into),
                error: None,
                cost: spend_of(opt("cost")),
            }
        }
        "approve" | "reject" => Command::Decide {
            run: run(),
            key: key(),
            decision: if verb == "approve" {
                Decision::Approve
            } else {
                Decision::Reject
            },
            reason: None,
        },
        "cancel" => Command::Cancel {
            run: run(),
            reason: None,
            kill: false,
        },
        "kill" => Command::Cancel {
            run: run(),
            reason: None,
            kill: true,
        },
        "pause" => Command::Pause { run: run() },
        "resume" => Command::Resume { run: run() },
        "close" => Command::Close {
            run: run(),
            failed: false,
        },
        "fail" => Command::Close {
            run: run(),
            failed: true,
        },
        "tick" => Command::Tick { run: run() },
        "compact" => Command::Compact {
            before: pos[0].parse().unwrap(),
            tombstones_before: pos.get(1).map_or(0, |t| t.parse().unwrap()),
        },
        "token_create" | "token_revoke" => Command::Token(TokenChange {
            action: if verb == "token_create" {
                TokenAction::Create
            } else {
                TokenAction::Revoke
            },
            name: PrincipalName::new(pos[0]).unwrap(),
            role: Role::parse(opt("role").unwrap_or("agent")).unwrap(),
            groups: opt("groups")
                .map(|g| g.split(',').map(Into::into).collect())
                .unwrap_or_default(),
        }),
        "begin" => Command::CompensationBegin {
            run: run(),
            key: key(),
            attempt: pos[2].parse().expect("attempt"),
            args: opt("args").map(Into::into),
        },
        "end" => Command::CompensationEnd {
            run: run(),
            key: key(),
            attempt: pos[2].parse().expect("attempt"),
            outcome: Outcome::parse(pos[3]).expect("outcome"),
            error: opt("error").map(Into::into),
        },
        "settle" => Command::Saga {
            run: run(),
            key: key(),
            action: SagaAction::Settle {
                outcome: Outcome::parse(pos[2]).expect("outcome"),
                result: opt("result").map(Into::into),
            },
        },
        "compensate" => Command::Saga {
            run: run(),
            key: key(),
            action: SagaAction::Compensate,
        },
        "lookup" => Command::SagaStep {
            run: run(),
            key: key(),
            step: SagaStep::LookupBegin {
                attempt: pos[2].parse().expect("attempt"),
            },
        },
        "found" => Command::SagaStep {
            run: run(),
            key: key(),
            step: SagaStep::LookupEnd {
                attempt: pos[2].parse().expect("attempt"),
                outcome: Outcome::parse(pos[3]).expect("outcome"),
                result: opt("result").map(Into::into),
                error: opt("error").map(Into::into),
            },
        },
        "blocked" => Command::SagaStep {
            run: run(),
            key: key(),
            step: SagaStep::Blocked {
                attempt: pos[2].parse().expect("attempt"),
                reason: opt("reason").unwrap_or("").into(),
            },
        },
        "hold" => Command::SagaStep {
            run: run(),
            key: key(),
            step: SagaStep::Held {
                attempt: pos[2].parse().expect("attempt"),
                quorum: opt("quorum").map_or(1, |q| q.parse().expect("quorum")),
                groups: opt("groups")
                    .map(|g| g.split(',').map(Into::into).collect())
                    .unwrap_or_default(),
                expiry_ms: opt("expiry").map_or(1000, |e| e.parse().expect("expiry")),
                args: opt("args").map(Into::into),
                reason: opt("reason").unwrap_or("policy").into(),
            },
        },
        "expired" => Command::SagaStep {
            run: run(),
            key: key(),
            step: SagaStep::Expired {
                approval: pos[2].parse().expect("approval id"),
            },
        },
        "unreported" => Command::SagaStep {
            run: run(),
            key: key(),
            step: SagaStep::Unreported {
                after_ms: pos[2].parse().expect("after_ms"),
            },
        },
        "retry" => Command::Saga {
            run: run(),
            key: key(),
            action: SagaAction::Retry,
        },
        "skip" => Command::Saga {
            run: run(),
            key: key(),
            action: SagaAction::Skip {
                reason: opt("reason").unwrap_or("").into(),
            },
        },
        v => panic!("unknown verb {v}"),
    };
    Record {
        at,
        principal,
        command,
    }
}

pub fn render_verdict(v: &Verdict) -> String {
    match v {
        Verdict::Admitted { token } => format!("admitted {token}"),
        Verdict::Go => "go".into(),
        Verdict::Held {
            reason,
            approval,
            expires_at,
        } => {
            let mut s = format!("held {reason}");
            if let Some(a) = approval {
                write!(s, " #{a}").unwrap();
            }
            if let Some(e) = expires_at {
                write!(s, " until {e}").unwrap();
            }
            s
        }
        Verdict::Refused { reason, over } => {
            let mut s = format!("refused {reason}");
            if let Some(o) = over {
                let d = o.dimension.as_str();
                write!(s, " {d} of {} used={} limit={}", o.run, o.used, o.limit).unwrap();
            }
            s
        }
        Verdict::Duplicate {
            status,
            outcome,
            result,
            ..
        } => {
            let mut s = format!("duplicate {status}");
            if let Some(o) = outcome {
                write!(s, " {o}").unwrap();
            }
            if let Some(r) = result {
                write!(s, " result={r}").unwrap();
            }
            s
        }
    }
}

pub fn render_reply(r: &Reply) -> String {
    match r {
        Reply::Verdict(v) => render_verdict(v),
        Reply::Disputed { settled } => format!("disputed settled={settled}"),
        Reply::Completed { late } => {
            if *late {
                "completed late".into()
            } else {
                "completed".into()
            }
        }
        Reply::Decided(Decided {
            status: DecideStatus::Approved,
            ..
        }) => "decided approved".into(),
        Reply::Decided(Decided {
            status: DecideStatus::Rejected,
            ..
        }) => "decided rejected".into(),
        Reply::Decided(Decided {
            status:
                DecideStatus::Pending {
                    approvals,
                    quorum,
                    missing_groups,
                },
            ..
        }) => {
            let mut s = format!("decided pending {approvals}/{quorum}");
            if !missing_groups.is_empty() {
                write!(s, " missing {}", missing_groups.join(",")).unwrap();
            }
            s
        }
        Reply::RunState {
            state,
            runs_changed,
        } => format!("run {state} ({runs_changed} changed)"),
        Reply::Compacted { runs, tombstones } => {
            format!("forgot {runs} runs, dropped {tombstones} tombstones")
        }
        Reply::TokenRecorded => "token recorded".into(),
        Reply::Compensation {
            status,
            attempt,
            retry_at,
        } => {
            let mut s = format!("compensation {status} attempt={attempt}");
            if let Some(at) = retry_at {
                write!(s, " retry_at={at}").unwrap();
            }
            s
        }
    }
}

pub fn render_state(gate: &Gate) -> String {
    let mut s = String::new();
    for (id, run) in gate.runs() {
        write!(s, "run {id} {}", run.state).unwrap();
        if let Some(stop) = &run.stop {
            write!(s, " stop={}", stop.cause).unwrap();
            if let Some(from) = &stop.from {
                write!(s, " from={from}").unwrap();
            }
        }
        write!(
            s,
            " epoch={} admitted={} pending={} in_flight={}",
            run.epoch, run.admitted, run.pending_approvals, run.in_flight
        )
        .unwrap();
        if let Some(p) = &run.parent {
            write!(s, " parent={p}").unwrap();
        }
        let (l, sp, rs) = (run.limits, run.spent, run.reserved);
        if l.max_spend.is_some() || l.max_tokens.is_some() || !sp.is_zero() || !rs.is_zero() {
            let lim = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
            write!(
                s,
                " spent={}/{} reserved={}/{} limit={}/{}",
                sp.usd_micros,
                sp.tokens,
                rs.usd_micros,
                rs.tokens,
                lim(l.max_spend),
                lim(l.max_tokens)
            )
            .unwrap();
        }
        if let Some(r) = run
            .stop
            .as_ref()
            .filter(|s| s.cause == estop_kernel::vocab::StopCause::Budget)
            .and_then(|s| s.reason.as_deref())
        {
            write!(s, " reason={r:?}").unwrap();
        }
        s.push('\n');
        for (k, e) in &run.effects {
            let status = match e.status {
                Status::Held(r) => format!("held({r})"),
                Status::Refused(r) => format!("refused({r})"),
                other => other.kind().to_string(),
            };
            write!(s, "  {k} {} {status}", e.tool).unwrap();
            if e.late {
                s.push_str(" late");
            }
            if e.holder != estop_kernel::Part::Main {
                write!(s, " holder={}", e.holder.as_str()).unwrap();
            }
            if e.disputes > 0 {
                write!(s, " disputes={}", e.disputes).unwrap();
            }
            if let Some(a) = &e.approval {
                let names: Vec<_> = a.approvers.iter().map(|a| a.name.to_string()).collect();
                if !names.is_empty() {
                    write!(s, " approvers={}", names.join(",")).unwrap();
                }
            }
            if let Some(c) = &e.compensate {
                write!(s, " undo={c}").unwrap();
            }
            if let Some(m) = &e.compensate_args {
                write!(s, " undo_args={m}").unwrap();
                if let Some(a) = &e.args {
                    write!(s, " args={a}").unwrap();
                }
            }
            if let Some(l) = &e.lookup {
                write!(s, " lookup={l}").unwrap();
            }
            if let Some(m) = &e.lookup_args {
                write!(s, " lookup_args={m}").unwrap();
            }
            if let Some(sp) = &e.spend {
                let r = sp.reserve;
                let counted = if sp.counted { "(counted)" } else { "" };
                write!(s, " reserve={}/{}{counted}", r.usd_micros, r.tokens).unwrap();
                if let Some(c) = sp.cost {
                    write!(s, " cost={}/{}", c.usd_micros, c.tokens).unwrap();
                }
            }
            if let Some(r) = e.outcome.as_ref().and_then(|o| o.result.as_deref()) {
                write!(s, " result={r}").unwrap();
            }
            if let Some(c) = &e.saga {
                write!(s, " attempts={}/{}", c.attempts, c.granted).unwrap();
                if c.lookups > 0 || c.lookups_granted > 1 {
                    write!(s, " lookups={}/{}", c.lookups, c.lookups_granted).unwrap();
                    if c.lookup_open {
                        s.push_str(" looking");
                    }
                }
                if c.chosen {
                    s.push_str(" chosen");
                }
                if let Some(n) = &c.note {
                    write!(s, " note={n:?}").unwrap();
                }
                if let Some(by) = &c.by {
                    write!(s, " by={by}").unwrap();
                }
                if let Some(a) = &c.approval {
                    let names: Vec<_> = a.approvers.iter().map(|a| a.name.to_string()).collect();
                    write!(s, " undo_approval=#{} {}/{}", a.id, names.len(), a.quorum).unwrap();
                    if !names.is_empty() {
                        write!(s, " by {}", names.join(",")).unwrap();
                    }
                    if let Some(r) = &a.rejected_by {
                        write!(s, " rejected_by={r}").unwrap();
                    }
                }
            }
            s.push('\n');
        }
        if let Some((key, next)) = estop_kernel::saga::next(run) {
            writeln!(s, "  saga next: {key} {next:?}").unwrap();
        }
    }
    for (id, t) in gate.tombstones() {
        let owner = t.owner.as_ref().map_or("-", |o| o.as_str());
        writeln!(
            s,
            "tombstone {id} {} stop={} at={} epoch={} owner={owner}",
            t.cause.terminal_state(),
            t.cause,
            t.stopped_at,
            t.epoch
        )
        .unwrap();
    }
    s
}

/// Runs a script; returns the transcript (each command and its reply, then the final state).
/// Panics if replaying the recorded commands, or a snapshot, does not reproduce the state.
pub fn run_script(script: &str) -> String {
    let mut limits = Limits {
        pending_approvals_per_run_max: 4,
        ..Limits::default()
    };
    let mut out = String::new();
    let mut log: Vec<Vec<u8>> = Vec::new();
    let mut last_token = None;
    let mut show_usage = false;
    let mut lines = script
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .peekable();
    // An optional first line `limits name=value ...` sets bounds for the script.
    if let Some(first) = lines.next_if(|l| l.starts_with("limits ")) {
        for word in first.split_whitespace().skip(1) {
            let (name, value) = word.split_once('=').expect("limits name=value");
            let value: usize = value.parse().expect("a number");
            match name {
                "runs_max" => limits.runs_max = value,
                "runs_per_principal_max" => limits.runs_per_principal_max = value,
                "held_max" => limits.held_max = value,
                "held_per_principal_max" => limits.held_per_principal_max = value,
                "tombstones_max" => limits.tombstones_max = value,
                other => panic!("unknown limit {other}"),
            }
        }
        writeln!(out, "{first}").unwrap();
        show_usage = true;
    }
    let mut gate = Gate::new(limits);
    for line in lines {
        let rec = parse_line(line, last_token);
        let before = gate.clone();
        match gate.apply(rec.at, &rec.principal, &rec.command) {
            Ok(applied) => {
                if let Reply::Verdict(Verdict::Admitted { token }) = &applied.reply {
                    last_token = Some(*token);
                }
                writeln!(out, "{line:<44} => {}", render_reply(&applied.reply)).unwrap();
                if applied.changed {
                    let mut buf = Vec::new();
                    encode_record(&rec, &mut buf);
                    assert_eq!(decode_record(&buf).as_ref(), Ok(&rec), "record round trip");
                    log.push(buf);
                } else {
                    assert_eq!(
                        before, gate,
                        "a command that reports no change changed the state: {line}"
                    );
                }
            }
            Err(e) => {
                assert_eq!(
                    before, gate,
                    "a command that failed changed the state: {line}"
                );
                writeln!(out, "{line:<44} => error {}: {e}", e.code()).unwrap();
            }
        }
    }
    // Replay: the recorded commands alone, through `replay` (no events), rebuild the state that
    // `apply` built, down to the snapshot bytes.
    let mut replayed = Gate::new(gate.limits().clone());
    let mut decoder = RecordDecoder::default();
    for buf in &log {
        let rec = decoder.decode(buf).unwrap();
        assert_eq!(Ok(&rec), decode_record(buf).as_ref(), "decoders differ");
        let changed = replayed
            .replay(rec.at, &rec.principal, &rec.command)
            .expect("a recorded command applies on replay");
        assert!(changed, "a recorded command changed nothing on replay");
    }
    assert_eq!(replayed, gate, "replay diverged");
    let mut snap = Vec::new();
    encode_snapshot(&gate, &mut snap);
    let mut replayed_snap = Vec::new();
    encode_snapshot(&replayed, &mut replayed_snap);
    assert!(
        snap == replayed_snap,
        "replay diverged in the snapshot bytes"
    );
    assert_eq!(
        decode_snapshot(&snap, gate.limits().clone()).as_ref(),
        Ok(&gate),
        "snapshot round trip"
    );
    out.push_str("--\n");
    out.push_str(&render_state(&gate));
    if show_usage {
        out.push_str(&render_usage(&gate));
    }
    out
}

/// What each owner holds, and the held effects in all (scripts that set limits show it).
pub fn render_usage(gate: &Gate) -> String {
    let owners: std::collections::BTreeSet<_> =
        gate.runs().filter_map(|(_, r)| r.owner.clone()).collect();
    let mut s = format!("held {}\n", gate.held_count());
    for o in owners {
        let u = gate.usage(&o);
        writeln!(s, "usage {o} runs={} held={}", u.runs, u.held).unwrap();
    }
    s
}

pub fn check(script: &str, expect: expect_test::Expect) {
    expect.assert_eq(&run_script(script));
}
