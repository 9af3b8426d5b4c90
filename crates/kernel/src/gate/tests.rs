//! Hostile states for the run-transition guard. Every stop (cancel, kill, close, a deadline, a
//! budget, a stopped parent's fence reaching an adopted subtree) moves a whole subtree; if one
//! run of it cannot legally move, the command is refused with a typed error before any run
//! changes: no panic, nothing half-applied, nothing to record.
//!
//! No command produces such a run (a stop sets `stop` and the state together), so the tests make
//! one by hand: a run that is `completed` yet never stopped stands for any disagreement between
//! the code and the table in `transitions` (the table has no way out of a terminal state).

use super::*;
use crate::command::RunLimits;
use crate::ids::{Digest, ToolName};
use crate::vocab::Reversibility;

fn id(s: &str) -> RunId {
    RunId::new(s).expect("valid id")
}

fn who(name: &str, role: Role) -> Principal {
    Principal {
        name: PrincipalName::new(name).expect("valid name"),
        role,
        groups: Vec::new(),
        part: Default::default(),
    }
}

fn agent() -> Principal {
    who("agent", Role::Agent)
}

fn operator() -> Principal {
    who("alice", Role::Operator)
}

fn admit(run: &str, key: &str, parent: Option<&str>, limits: RunLimits) -> Command {
    admit_as(PolicyAction::Allow, run, key, parent, limits)
}

fn admit_as(
    action: PolicyAction,
    run: &str,
    key: &str,
    parent: Option<&str>,
    limits: RunLimits,
) -> Command {
    Command::Admit(Admit {
        run: id(run),
        key: EffectKey::new(key).expect("valid key"),
        tool: ToolName::new("pay").expect("valid tool"),
        digest: Digest([key.as_bytes()[0]; 32]),
        args: None,
        start: false,
        parent: parent.map(id),
        labels: Vec::new(),
        limits,
        policy: PolicyDecision {
            action,
            class: EffectClass::Write,
            reversibility: Reversibility::Undeclared,
            compensate: None,
            compensate_args: None,
            lookup: None,
            lookup_args: None,
            quorum: 1,
            groups: Vec::new(),
            expiry_ms: 1000,
            rule: "test".into(),
        }
        .into(),
        reserve: Default::default(),
    })
}

fn token_of(applied: Applied) -> Token {
    match applied.reply {
        Reply::Verdict(Verdict::Admitted { token }) => token,
        other => panic!("expected an admission, got {other:?}"),
    }
}

/// r1 (deadline 100, budget 1) → r2 → r3, each with one prepared effect `k`; r2 has `h` held
/// for approval and r3 `s` held behind it (a sibling); returns the gate and r1's token.
fn tree() -> (Gate, Token) {
    let mut gate = Gate::new(Limits::default());
    let r1_limits = RunLimits {
        deadline_at: Some(100),
        max_effects: Some(1),
        ..RunLimits::default()
    };
    let a = agent();
    let token = token_of(
        gate.apply(0, &a, &admit("r1", "k", None, r1_limits))
            .unwrap(),
    );
    let none = RunLimits::default();
    gate.apply(0, &a, &admit("r2", "k", Some("r1"), none))
        .unwrap();
    gate.apply(0, &a, &admit("r3", "k", Some("r2"), none))
        .unwrap();
    let approve = admit_as(PolicyAction::Approve, "r2", "h", Some("r1"), none);
    gate.apply(0, &a, &approve).unwrap();
    let held = gate
        .apply(0, &a, &admit("r3", "s", Some("r2"), none))
        .unwrap();
    assert!(matches!(held.reply, Reply::Verdict(Verdict::Held { .. })));
    (gate, token)
}

/// Makes `run` terminal without a stop: no legal move of a stop is left for it.
fn corrupt(gate: &mut Gate, run: &str) {
    gate.runs.get_mut(&id(run)).expect("run exists").state = RunState::Completed;
}

/// Every command that stops r1's subtree, with the time and principal it is given at.
fn cascades(token: Token) -> Vec<(u64, Principal, Command)> {
    let cancel = |kill| Command::Cancel {
        run: id("r1"),
        reason: None,
        kill,
    };
    let close = |failed| Command::Close {
        run: id("r1"),
        failed,
    };
    let none = RunLimits::default();
    vec![
        (10, agent(), cancel(false)),
        (10, operator(), cancel(true)),
        (10, agent(), close(false)),
        (10, agent(), close(true)),
        // r1's budget of one admission is spent: the next admit fences its subtree.
        (10, agent(), admit("r1", "k2", None, none)),
        // Past r1's deadline: a tick of r1 or of a descendant, an admit under it (in a run that
        // exists or one it creates), a start, a wait on an effect held behind a sibling.
        (200, agent(), Command::Tick { run: id("r1") }),
        (200, agent(), Command::Tick { run: id("r2") }),
        (200, agent(), admit("r2", "k2", Some("r1"), none)),
        (200, agent(), admit("r4", "k", Some("r1"), none)),
        (
            200,
            agent(),
            Command::Start {
                run: id("r1"),
                key: EffectKey::new("k").expect("valid key"),
                token,
            },
        ),
        (
            200,
            agent(),
            Command::Recheck {
                run: id("r3"),
                key: EffectKey::new("s").expect("valid key"),
            },
        ),
    ]
}

#[test]
fn each_cascade_reaches_the_whole_subtree_on_a_sound_tree() {
    // The hostile test below is worth something only if these commands move r3.
    let (sound, token) = tree();
    for (now, p, cmd) in cascades(token) {
        let mut gate = sound.clone();
        let applied = gate.apply(now, &p, &cmd).expect("applies");
        assert!(applied.changed, "{cmd:?}");
        for r in ["r1", "r2", "r3"] {
            assert!(gate.runs[&id(r)].stop.is_some(), "{cmd:?} stops {r}");
        }
    }
}

#[test]
fn a_cascade_with_one_illegal_move_is_refused_and_changes_nothing() {
    let (mut hostile, token) = tree();
    corrupt(&mut hostile, "r3");
    for (now, p, cmd) in cascades(token) {
        let mut gate = hostile.clone();
        let err = gate.apply(now, &p, &cmd).expect_err("refused");
        assert_eq!(err.code(), "illegal_transition", "{cmd:?}: {err}");
        assert!(err.to_string().contains("run r3 from completed"), "{err}");
        assert_eq!(gate, hostile, "{cmd:?} changed the state");
        // Replay refuses the same way (a record of it would never replay).
        let mut replayed = hostile.clone();
        assert_eq!(replayed.replay(now, &p, &cmd), Err(err));
        assert_eq!(replayed, hostile);
    }
}

#[test]
fn a_fence_of_an_adopted_subtree_is_checked_before_it_is_adopted() {
    let mut gate = Gate::new(Limits::default());
    let none = RunLimits::default();
    // `c`'s admit brings its parent `q` into being, parentless and effectless.
    gate.apply(0, &agent(), &admit("c", "k", Some("q"), none))
        .unwrap();
    let fence = Command::Cancel {
        run: id("s"),
        reason: None,
        kill: false,
    };
    gate.apply(0, &operator(), &fence).unwrap();
    let overdue = RunLimits {
        deadline_at: Some(100),
        max_effects: None,
        ..RunLimits::default()
    };
    gate.apply(0, &agent(), &admit("o", "k", None, overdue))
        .unwrap();
    let sound = gate.clone();
    corrupt(&mut gate, "c");
    let hostile = gate.clone();
    // `q`'s first admit names a stopped parent, or one past its deadline: q's subtree is
    // adopted and fenced at once.
    for parent in ["s", "o"] {
        let adopt = admit("q", "k", Some(parent), none);
        let mut gate = hostile.clone();
        let err = gate.apply(200, &agent(), &adopt).expect_err("refused");
        assert_eq!(err.code(), "illegal_transition", "{parent}: {err}");
        assert!(err.to_string().contains("run c from completed"), "{err}");
        assert_eq!(gate, hostile, "under {parent}");
        // The same admit on the sound gate adopts and fences both.
        let mut gate = sound.clone();
        gate.apply(200, &agent(), &adopt).unwrap();
        assert_eq!(gate.runs[&id("q")].parent, Some(id(parent)));
        assert!(gate.runs[&id("c")].stop.is_some(), "under {parent}");
    }
}

#[test]
fn a_snapshot_whose_run_state_and_stop_disagree_is_refused() {
    use crate::record_codec::{decode_snapshot, encode_snapshot};
    let (mut gate, _) = tree();
    let mut buf = Vec::new();
    encode_snapshot(&gate, &mut buf);
    assert_eq!(decode_snapshot(&buf, Limits::default()).as_ref(), Ok(&gate));
    // Terminal without a stop: what the hostile tests above make by hand.
    corrupt(&mut gate, "r3");
    buf.clear();
    encode_snapshot(&gate, &mut buf);
    let err = decode_snapshot(&buf, Limits::default()).expect_err("refused");
    assert!(
        err.to_string().contains("run r3 is completed with no stop"),
        "{err}"
    );
    // Stopped yet still active.
    let (mut gate, _) = tree();
    gate.apply(
        10,
        &agent(),
        &Command::Close {
            run: id("r3"),
            failed: false,
        },
    )
    .unwrap();
    gate.runs.get_mut(&id("r3")).expect("exists").state = RunState::Active;
    buf.clear();
    encode_snapshot(&gate, &mut buf);
    let err = decode_snapshot(&buf, Limits::default()).expect_err("refused");
    assert!(
        err.to_string().contains("run r3 is active with a stop"),
        "{err}"
    );
}
