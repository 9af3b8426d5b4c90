//! Property tests: random command sequences on a small domain, checking guarantees G1–G5 as
//! properties of the trace (every transition is compared against the state before it), and that
//! replaying the recorded commands reproduces the final state.

mod support;

use estop_kernel::record_codec::{
    RecordDecoder, decode_record, decode_snapshot, encode_record, encode_snapshot,
};
use estop_kernel::saga;
use estop_kernel::state::Status;
use estop_kernel::transitions::RUN_TRANSITIONS;
use estop_kernel::vocab::{
    EffectClass, HoldReason, PolicyAction, RefusalReason, RunState, StopCause,
};
use estop_kernel::{Command, Gate, Limits, RunId};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use support::parse_line;

fn op() -> impl Strategy<Value = String> {
    let run = prop_oneof![Just("r1"), Just("r2")];
    let key = prop_oneof![Just("a"), Just("b"), Just("c"), Just("d")];
    let tool = prop_oneof![
        Just("pay action=allow"),
        Just("read class=read"),
        Just("refund action=approve expiry=50"),
        Just("refund action=approve quorum=2 expiry=80"),
        Just("wipe action=deny"),
        Just("give comp=ungive"),
    ];
    let arg = prop_oneof![Just("x"), Just("y")];
    let start = prop_oneof![Just(""), Just(" start=false")];
    let who_op = prop_oneof![Just("alice"), Just("bob")];
    prop_oneof![
        6 => (run.clone(), key.clone(), tool, arg, start).prop_map(|(r, k, t, a, s)| {
            let parent = if r == "r2" { " parent=r1" } else { "" };
            let (name, rest) = t.split_once(' ').unwrap();
            format!("agent admit {r} {k} {name} arg={a} {rest}{s}{parent}")
        }),
        3 => (run.clone(), key.clone()).prop_map(|(r, k)| format!("agent wait {r} {k}")),
        3 => (run.clone(), key.clone()).prop_map(|(r, k)| format!("agent start {r} {k} last")),
        2 => (run.clone(), key.clone(), prop_oneof![Just("ok"), Just("error"), Just("unknown")])
            .prop_map(|(r, k, o)| format!("agent complete {r} {k} last {o}")),
        4 => (who_op.clone(), run.clone(), key.clone(), prop_oneof![Just("approve"), Just("reject")])
            .prop_map(|(w, r, k, d)| format!("{w} {d} {r} {k}")),
        1 => (who_op.clone(), run.clone(), prop_oneof![Just("cancel"), Just("kill"), Just("pause"), Just("resume"), Just("close")])
            .prop_map(|(w, r, v)| format!("{w} {v} {r}")),
        1 => run.clone().prop_map(|r| format!("agent tick {r}")),
        // The reverse saga: executors begin and end numbered attempts, operators settle, retry
        // and skip.
        3 => (run.clone(), key.clone(), 1u32..4).prop_map(|(r, k, n)| format!("agent begin {r} {k} {n}")),
        3 => (run.clone(), key.clone(), 1u32..4, prop_oneof![Just("ok"), Just("error"), Just("unknown")])
            .prop_map(|(r, k, n, o)| format!("agent end {r} {k} {n} {o}")),
        2 => (who_op, run.clone(), key.clone(), prop_oneof![Just("settle {} {} ok"), Just("settle {} {} error"), Just("retry {} {}"), Just("skip {} {} reason=x")])
            .prop_map(|(w, r, k, v)| format!("{w} {}", v.replacen("{}", r, 1).replacen("{}", k, 1))),
        1 => (0u64..60, 0u64..200).prop_map(|(a, b)| format!("agent compact-ago {a} {b}")),
    ]
}

/// Commands that move runs, on a three-level tree whose root may have a deadline and a budget:
/// every stop verb, from operators and the agent, and the outcomes that settle a stopped run.
fn run_op() -> impl Strategy<Value = String> {
    let run = prop_oneof![Just("r1"), Just("r2"), Just("r3")];
    let parent = |r: &str| match r {
        "r2" => " parent=r1",
        "r3" => " parent=r2",
        _ => " deadline=300 max=4",
    };
    let key = prop_oneof![Just("a"), Just("b")];
    let who = prop_oneof![Just("agent"), Just("alice")];
    let verb = prop_oneof![
        Just("cancel"),
        Just("kill"),
        Just("pause"),
        Just("resume"),
        Just("close"),
        Just("fail"),
        Just("tick"),
    ];
    prop_oneof![
        4 => (run.clone(), key.clone(), prop_oneof![Just(""), Just(" start=false"), Just(" action=approve")])
            .prop_map(move |(r, k, o)| format!("agent admit {r} {k} pay{o}{}", parent(r))),
        2 => (run.clone(), key.clone()).prop_map(|(r, k)| format!("agent start {r} {k} last")),
        2 => (run.clone(), key.clone(), prop_oneof![Just("ok"), Just("error"), Just("unknown")])
            .prop_map(|(r, k, o)| format!("agent complete {r} {k} last {o}")),
        1 => (run.clone(), key).prop_map(|(r, k)| format!("alice approve {r} {k}")),
        3 => (who, verb, run).prop_map(|(w, v, r)| format!("{w} {v} {r}")),
        1 => (0u64..60, 0u64..200).prop_map(|(a, b)| format!("agent compact-ago {a} {b}")),
    ]
}

/// Small bounds, so quotas, the operator reserve and the tombstone bound are reached.
fn limits() -> Limits {
    Limits {
        runs_max: 3,
        held_max: 4,
        held_per_principal_max: 3,
        tombstones_max: 1,
        ..Limits::default()
    }
}

/// The script line for `line` at `now` (`compact-ago A B`: retention cut-offs A and B ms ago).
fn at(now: u64, line: &str) -> String {
    match line.strip_prefix("agent compact-ago ") {
        Some(ago) => {
            let (a, b) = ago.split_once(' ').unwrap();
            let cut = |x: &str| now.saturating_sub(x.parse().unwrap());
            format!("{now} agent compact {} {}", cut(a), cut(b))
        }
        None => format!("{now} {line}"),
    }
}

/// The derived counters and indexes agree with the state they summarize.
fn check_counters(gate: &Gate) -> Result<(), TestCaseError> {
    let mut usage: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut held_total = 0;
    for (id, run) in gate.runs() {
        let held = run.effects.values().filter(|e| e.status.is_held()).count() as u64;
        prop_assert_eq!(held, u64::from(run.held), "held counter drifted in {}", id);
        held_total += held;
        if let Some(o) = &run.owner {
            let u = usage.entry(o.to_string()).or_default();
            u.0 += 1;
            u.1 += held;
        }
        for c in &run.children {
            prop_assert!(gate.run(c).is_some(), "{} names forgotten child {}", id, c);
        }
        prop_assert!(
            gate.tombstone(id).is_none(),
            "{} is a run and a tombstone",
            id
        );
    }
    prop_assert_eq!(held_total, gate.held_count());
    for (name, (runs, held)) in &usage {
        let u = gate.usage(&estop_kernel::PrincipalName::new(name).unwrap());
        prop_assert_eq!(
            (u.runs, u.held),
            (*runs, *held),
            "usage of {} drifted",
            name
        );
    }
    let l = gate.limits();
    prop_assert!(gate.run_count() <= l.runs_max);
    prop_assert!(gate.tombstone_count() <= l.tombstones_max);
    prop_assert!(gate.held_count() as usize <= l.held_max);
    Ok(())
}

fn chain(gate: &Gate, run: &RunId) -> Vec<RunId> {
    let mut out = vec![run.clone()];
    while let Some(p) = gate.run(out.last().unwrap()).and_then(|r| r.parent.clone()) {
        out.push(p);
    }
    out
}

/// What the saga checks remember across steps.
#[derive(Default)]
struct SagaSeen {
    compensated: BTreeSet<(RunId, String)>,
    begun: BTreeMap<(RunId, String), u32>,
}

/// The saga's guarantees over one step of one run: a compensation begins only after a cancel,
/// each attempt once and numbered upwards, newest first; none completes twice; a cancelled run
/// is cancelled only with its saga settled.
fn check_saga_step(
    run_id: &RunId,
    old_run: Option<&estop_kernel::state::Run>,
    run: &estop_kernel::state::Run,
    seen: &mut SagaSeen,
) -> Result<(), TestCaseError> {
    for (key, e) in &run.effects {
        let was = old_run.and_then(|r| r.effects.get(key)).map(|o| o.status);
        let id = (run_id.clone(), key.to_string());
        if e.status == Status::Compensating && was != Some(Status::Compensating) {
            // An attempt a policy held for approval begins only once its quorum met it.
            let approval = e.saga.as_ref().and_then(|c| c.approval.as_deref());
            prop_assert!(
                approval.is_none_or(|a| a.satisfied() && a.rejected_by.is_none()),
                "{}/{} began without its approval: {:?}",
                run_id,
                key,
                approval
            );
            let cause = run.stop.as_ref().map(|s| s.cause);
            prop_assert_eq!(
                cause,
                Some(StopCause::Cancelled),
                "compensation of {}/{} without a cancel",
                run_id,
                key
            );
            let attempt = e.saga.as_ref().unwrap().attempts;
            let last = seen.begun.insert(id.clone(), attempt).unwrap_or(0);
            prop_assert!(
                attempt > last,
                "attempt {} of {}/{} began again",
                attempt,
                run_id,
                key
            );
            let serial = e.token.unwrap().serial;
            for (k2, e2) in &run.effects {
                if saga::member(e2) && e2.token.unwrap().serial > serial {
                    prop_assert!(
                        matches!(e2.status, Status::Compensated | Status::CompensationSkipped),
                        "{}/{} compensated before newer {} ({})",
                        run_id,
                        key,
                        k2,
                        e2.status.kind()
                    );
                }
            }
        }
        if e.status == Status::Compensated && was != Some(Status::Compensated) {
            prop_assert!(
                seen.compensated.insert(id),
                "{}/{} compensated twice",
                run_id,
                key
            );
        }
    }
    if run.state == RunState::Cancelled
        && run
            .stop
            .as_ref()
            .is_some_and(|s| s.cause == StopCause::Cancelled)
    {
        prop_assert!(!saga::owed(run), "{} cancelled with its saga open", run_id);
    }
    Ok(())
}

/// Steps of one run's life with compensable effects: each admission comes with its outcome (so
/// the token is the right one), then stops, executors' attempts and operators' words.
fn saga_op() -> impl Strategy<Value = Vec<String>> {
    let key = prop_oneof![Just("a"), Just("b"), Just("c")];
    prop_oneof![
        3 => (key.clone(), prop_oneof![Just("ok"), Just("unknown"), Just("error"), Just("")]).prop_map(|(k, o)| {
            let mut v = vec![format!("agent admit r1 {k} give arg={k} comp=ungive")];
            if !o.is_empty() {
                v.push(format!("agent complete r1 {k} last {o}"));
            }
            v
        }),
        1 => prop_oneof![Just("alice cancel r1"), Just("alice kill r1"), Just("agent close r1")]
            .prop_map(|l| vec![l.to_string()]),
        4 => (key.clone(), 1u32..4).prop_map(|(k, n)| vec![format!("agent begin r1 {k} {n}")]),
        4 => (key.clone(), 1u32..4, prop_oneof![Just("ok"), Just("error"), Just("unknown")])
            .prop_map(|(k, n, o)| vec![format!("agent end r1 {k} {n} {o}")]),
        2 => (key.clone(), prop_oneof![Just("settle {} ok"), Just("settle {} error"), Just("retry {}"), Just("skip {} reason=x")])
            .prop_map(|(k, v)| vec![format!("alice {}", v.replacen("{}", &format!("r1 {k}"), 1))]),
        // A policy holding the compensating call for a quorum of 2 (group finance), and the
        // votes, rejections and expiries that decide it.
        2 => (key.clone(), 1u32..4).prop_map(|(k, n)| vec![format!("alice hold r1 {k} {n} quorum=2 groups=finance expiry=2000")]),
        3 => (key.clone(), prop_oneof![Just("alice approve"), Just("bob approve"), Just("carol approve"), Just("agent approve"), Just("bob reject")])
            .prop_map(|(k, v)| vec![format!("{v} r1 {k}")]),
        1 => (key, 1u64..4).prop_map(|(k, id)| vec![format!("alice expired r1 {k} {id}")]),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn guarantees_hold_on_random_traces(ops in prop::collection::vec((op(), 0u64..30), 1..60)) {
        let mut gate = Gate::new(limits());
        let mut now = 0u64;
        let mut last_token = None;
        let mut admissions: BTreeMap<(RunId, String), u32> = BTreeMap::new();
        let mut rejected: BTreeSet<(RunId, [u8; 32])> = BTreeSet::new();
        let mut cancelled: BTreeSet<RunId> = BTreeSet::new();
        let mut saga_seen = SagaSeen::default();
        let mut log = Vec::new();
        for (line, dt) in &ops {
            now += dt;
            let rec = parse_line(&at(now, line), last_token);
            let before = gate.clone();
            let Ok(applied) = gate.apply(rec.at, &rec.principal, &rec.command) else {
                prop_assert_eq!(&before, &gate, "an error changed state");
                continue;
            };
            if applied.changed { log.push(rec.clone()); } else { prop_assert_eq!(&before, &gate); }
            if let estop_kernel::Reply::Verdict(estop_kernel::Verdict::Admitted { token }) = applied.reply {
                last_token = Some(token);
            }
            for (run_id, run) in gate.runs() {
                let old_run = before.run(run_id);
                // Terminal states absorb.
                if let Some(old) = old_run.filter(|o| o.state.is_terminal()) {
                    prop_assert_eq!(old.state, run.state);
                }
                for (key, e) in &run.effects {
                    let old = old_run.and_then(|r| r.effects.get(key));
                    let was = old.map(|o| o.status);
                    let admitted_now = matches!(e.status, Status::Admitted | Status::Started)
                        && !matches!(was, Some(Status::Admitted | Status::Started));
                    let started_now = e.status == Status::Started && was != Some(Status::Started);
                    if admitted_now {
                        // G3: one admission per identity, ever.
                        let n = admissions.entry((run_id.clone(), key.to_string())).or_default();
                        *n += 1;
                        prop_assert_eq!(*n, 1, "double admission of {}/{}", run_id, key);
                        // G1: approval before admission, unexpired, quorum met.
                        if e.action == PolicyAction::Approve {
                            let a = e.approval.as_ref().unwrap();
                            prop_assert!(a.satisfied(), "admitted without quorum");
                            prop_assert!(now < a.expires_at, "admitted on an expired approval (G5)");
                        }
                        prop_assert!(e.action != PolicyAction::Deny);
                        // G2: a rejected call is never admitted again in the run.
                        prop_assert!(!rejected.contains(&(run_id.clone(), e.digest.0)), "rejected digest admitted");
                    }
                    if admitted_now || started_now {
                        // G4: nothing admitted or started after a cancel of the run or an ancestor.
                        for r in chain(&gate, run_id) {
                            prop_assert!(!cancelled.contains(&r), "effect {}/{} started after cancel of {}", run_id, key, r);
                        }
                    }
                    if started_now && e.class == EffectClass::Write {
                        // G1: no write starts while an approval is pending in the run's chain.
                        for r in chain(&before, run_id) {
                            let pending = before.run(&r).map_or(0, |x| x.pending_approvals);
                            prop_assert_eq!(pending, 0, "write {}/{} started while {} awaits approval", run_id, key, r);
                        }
                        for r in chain(&gate, run_id) {
                            let paused = gate.run(&r).is_some_and(|x| x.state == RunState::Paused);
                            prop_assert!(!paused, "started while paused");
                        }
                    }
                    if e.status == Status::Refused(RefusalReason::Rejected) && was != Some(e.status) {
                        rejected.insert((run_id.clone(), e.digest.0));
                    }
                }
                check_saga_step(run_id, old_run, run, &mut saga_seen)?;
                let held = run.effects.values().filter(|e| e.status == Status::Held(HoldReason::Approval)).count();
                prop_assert_eq!(held as u32, run.pending_approvals, "pending counter drifted in {}", run_id);
                let expected: std::collections::BTreeSet<_> = run.effects.iter()
                    .filter(|(_, e)| matches!(e.status, Status::Held(HoldReason::Approval) | Status::Approved))
                    .map(|(k, e)| (e.approval.as_ref().unwrap().expires_at, k.clone()))
                    .collect();
                prop_assert_eq!(&expected, &run.expiries, "expiry index drifted in {}", run_id);
                let flying = run.effects.values().filter(|e| e.status == Status::Started).count();
                prop_assert_eq!(flying as u32, run.in_flight, "in-flight counter drifted in {}", run_id);
            }
            if let Command::Cancel { run, .. } = &rec.command {
                cancelled.insert(run.clone());
            }
            check_counters(&gate)?;
            // G2, G3 and G4 remember a run until its tombstone expires; then the id is new.
            let known = |r: &RunId| gate.run(r).is_some() || gate.tombstone(r).is_some();
            cancelled.retain(|r| known(r));
            saga_seen.compensated.retain(|(r, _)| known(r));
            saga_seen.begun.retain(|(r, _), _| known(r));
            admissions.retain(|(r, _), _| known(r));
            rejected.retain(|(r, _)| known(r));
        }
        let mut replayed = Gate::new(limits());
        for rec in &log {
            prop_assert!(replayed.replay(rec.at, &rec.principal, &rec.command).unwrap());
        }
        prop_assert_eq!(replayed, gate);
    }

    /// The reverse saga on one run whose effects are compensable: the saga's guarantees hold
    /// on every step, and replay reproduces the state.
    #[test]
    fn saga_guarantees_hold_on_random_traces(ops in prop::collection::vec((saga_op(), 0u64..3000), 1..40)) {
        let mut gate = Gate::new(limits());
        let mut now = 0u64;
        let mut last_token = None;
        let mut seen = SagaSeen::default();
        let mut log = Vec::new();
        for (lines, dt) in &ops {
            now += dt;
            for line in lines {
                let rec = parse_line(&at(now, line), last_token);
                let before = gate.clone();
                let Ok(applied) = gate.apply(rec.at, &rec.principal, &rec.command) else {
                    prop_assert_eq!(&before, &gate, "an error changed state");
                    continue;
                };
                if applied.changed { log.push(rec.clone()); } else { prop_assert_eq!(&before, &gate); }
                if let estop_kernel::Reply::Verdict(estop_kernel::Verdict::Admitted { token }) = applied.reply {
                    last_token = Some(token);
                }
                for (run_id, run) in gate.runs() {
                    check_saga_step(run_id, before.run(run_id), run, &mut seen)?;
                }
            }
        }
        let mut replayed = Gate::new(limits());
        for rec in &log {
            prop_assert!(replayed.replay(rec.at, &rec.principal, &rec.command).unwrap());
        }
        prop_assert_eq!(replayed, gate);
    }

    /// Decoding a ledger's records in order, sharing what repeats, gives exactly what decoding
    /// each alone gives, for damaged records (their errors) as well.
    #[test]
    fn record_decoder_matches_decode_record(
        ops in prop::collection::vec((op(), 0u64..30, prop::option::of((any::<prop::sample::Index>(), any::<u8>()))), 1..60),
    ) {
        let mut decoder = RecordDecoder::default();
        let mut now = 0u64;
        for (line, dt, damage) in &ops {
            now += dt;
            let rec = parse_line(&at(now, line), None);
            let mut buf = Vec::new();
            encode_record(&rec, &mut buf);
            if let Some((at, byte)) = damage {
                let at = at.index(buf.len());
                buf[at] = *byte;
            }
            prop_assert_eq!(decoder.decode(&buf), decode_record(&buf), "{}", line);
        }
    }

    /// `replay` is `apply` without events: for every command, recorded or not, it gives the
    /// same change flag or the same error, and leaves the same state, down to the snapshot bytes.
    #[test]
    fn replay_matches_apply_command_by_command(ops in prop::collection::vec((op(), 0u64..30), 1..60)) {
        let mut applied = Gate::new(limits());
        let mut replayed = Gate::new(limits());
        let mut now = 0u64;
        let mut last_token = None;
        for (line, dt) in &ops {
            now += dt;
            let rec = parse_line(&at(now, line), last_token);
            let a = applied.apply(rec.at, &rec.principal, &rec.command);
            let r = replayed.replay(rec.at, &rec.principal, &rec.command);
            prop_assert_eq!(a.as_ref().map(|a| a.changed), r.as_ref().copied(), "{}", line);
            if let Ok(estop_kernel::Applied { reply: estop_kernel::Reply::Verdict(estop_kernel::Verdict::Admitted { token }), .. }) = a {
                last_token = Some(token);
            }
            prop_assert_eq!(&applied, &replayed, "{}", line);
        }
        let (mut a, mut r) = (Vec::new(), Vec::new());
        encode_snapshot(&applied, &mut a);
        encode_snapshot(&replayed, &mut r);
        prop_assert!(a == r, "snapshot bytes differ");
    }

    /// Whatever the commands, no panic: runs move only along the table (a stop reaching a whole
    /// subtree included), a refusal changes nothing, a run is stopped exactly when it is
    /// finalizing or terminal, and the state survives a snapshot.
    #[test]
    fn runs_move_only_along_the_table(ops in prop::collection::vec((run_op(), 0u64..40), 1..80)) {
        let mut gate = Gate::new(limits());
        let mut now = 0u64;
        let mut last_token = None;
        for (line, dt) in &ops {
            now += dt;
            let rec = parse_line(&at(now, line), last_token);
            let before = gate.clone();
            match gate.apply(rec.at, &rec.principal, &rec.command) {
                Err(e) => {
                    prop_assert_eq!(&before, &gate, "{} changed the state", line);
                    prop_assert_ne!(e.code(), "illegal_transition", "{}: {}", line, e);
                }
                Ok(applied) => {
                    if let estop_kernel::Reply::Verdict(estop_kernel::Verdict::Admitted { token }) = applied.reply {
                        last_token = Some(token);
                    }
                }
            }
            for (id, run) in gate.runs() {
                if let Some(from) = before.run(id).map(|r| r.state) {
                    let to = run.state;
                    prop_assert!(from == to || RUN_TRANSITIONS.contains(&(from, to)), "{}: {} {} -> {}", line, id, from, to);
                }
                let stopped = run.state == RunState::Finalizing || run.state.is_terminal();
                prop_assert_eq!(stopped, run.stop.is_some(), "{}: {} is {}", line, id, run.state);
            }
        }
        let mut snap = Vec::new();
        encode_snapshot(&gate, &mut snap);
        prop_assert_eq!(decode_snapshot(&snap, limits()), Ok(gate));
    }
}
