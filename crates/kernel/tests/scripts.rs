//! Kernel behaviour as data: each test is a script of commands and the transcript it must give.
//! Regenerate after an intended change with `UPDATE_EXPECT=1 cargo test -p estop-kernel`, then
//! read the diff: every line is a promise to users.

mod support;

use estop_kernel::{Gate, Limits, RunId};
use expect_test::expect;
use std::fmt::Write;
use support::check;

#[test]
fn allow_admits_and_starts_with_receipt_on_repeat() {
    check(
        "
        0 agent admit r1 k1 search class=read
        1 agent complete r1 k1 ok result=42
        2 agent admit r1 k1 search class=read
        3 agent admit r1 k1 search arg=other
        ",
        expect![[r#"
            0 agent admit r1 k1 search class=read        => admitted 1.1
            1 agent complete r1 k1 ok result=42          => completed
            2 agent admit r1 k1 search class=read        => duplicate completed ok result=42
            3 agent admit r1 k1 search arg=other         => refused mismatch
            --
            run r1 active epoch=1 admitted=1 pending=0 in_flight=0
              k1 search completed result=42
        "#]],
    );
}

#[test]
fn two_phase_prepare_start_complete() {
    check(
        "
        0 agent admit r1 k1 pay start=false
        1 agent admit r1 k1 pay start=false
        2 agent start r1 k1 1.1
        3 agent start r1 k1 1.1
        4 agent admit r1 k1 pay
        5 agent complete r1 k1 1.1 ok
        6 agent complete r1 k1 1.1 ok
        7 agent complete r1 k1 1.1 error
        8 agent start r1 k1 9.9
        ",
        expect![[r#"
            0 agent admit r1 k1 pay start=false          => admitted 1.1
            1 agent admit r1 k1 pay start=false          => admitted 1.1
            2 agent start r1 k1 1.1                      => go
            3 agent start r1 k1 1.1                      => duplicate started
            4 agent admit r1 k1 pay                      => duplicate started
            5 agent complete r1 k1 1.1 ok                => completed
            6 agent complete r1 k1 1.1 ok                => completed
            7 agent complete r1 k1 1.1 error             => disputed settled=completed
            8 agent start r1 k1 9.9                      => error bad_token: the token does not belong to effect k1 of run r1
            --
            run r1 active epoch=1 admitted=1 pending=0 in_flight=0
              k1 pay completed disputes=1
        "#]],
    );
}

/// An effect belongs to the part of the principal that admitted it: the sandbox (the agent's
/// `main` part, behind `estop run`'s relay) cannot admit again, wait for, start or complete
/// what the supervisor's `egress` part admitted (its proxy's requests, its metered calls),
/// even with the right token; the holder does all of it. The other way round too.
#[test]
fn only_the_part_that_admitted_an_effect_acts_on_it() {
    check(
        "
        0 agent+egress admit r1 k1 http.POST start=false
        1 agent admit r1 k1 http.POST start=false
        2 agent wait r1 k1
        3 agent start r1 k1 1.1
        4 agent+egress start r1 k1 1.1
        5 agent complete r1 k1 1.1 error
        6 agent complete r1 k1 1.1 ok cost=0/0
        7 agent+egress complete r1 k1 1.1 ok result=7
        8 agent admit r1 k2 search
        9 agent+egress complete r1 k2 1.2 error
        10 agent complete r1 k2 1.2 ok
        ",
        expect![[r#"
            0 agent+egress admit r1 k1 http.POST start=false => admitted 1.1
            1 agent admit r1 k1 http.POST start=false    => error forbidden: effect k1 of run r1 was admitted by the run's egress part: only that part may admit it again, wait for it, start or complete it
            2 agent wait r1 k1                           => error forbidden: effect k1 of run r1 was admitted by the run's egress part: only that part may admit it again, wait for it, start or complete it
            3 agent start r1 k1 1.1                      => error forbidden: effect k1 of run r1 was admitted by the run's egress part: only that part may admit it again, wait for it, start or complete it
            4 agent+egress start r1 k1 1.1               => go
            5 agent complete r1 k1 1.1 error             => error forbidden: effect k1 of run r1 was admitted by the run's egress part: only that part may admit it again, wait for it, start or complete it
            6 agent complete r1 k1 1.1 ok cost=0/0       => error forbidden: effect k1 of run r1 was admitted by the run's egress part: only that part may admit it again, wait for it, start or complete it
            7 agent+egress complete r1 k1 1.1 ok result=7 => completed
            8 agent admit r1 k2 search                   => admitted 1.2
            9 agent+egress complete r1 k2 1.2 error      => error forbidden: effect k2 of run r1 was admitted by the run's main part: only that part may admit it again, wait for it, start or complete it
            10 agent complete r1 k2 1.2 ok               => completed
            --
            run r1 active epoch=1 admitted=2 pending=0 in_flight=0
              k1 http.POST completed holder=egress result=7
              k2 search completed
        "#]],
    );
}

/// A second completion that contradicts the settled outcome or cost is refused and recorded
/// (counted on the effect, replayed from the ledger), never silently dropped; a repeat of the
/// same outcome and cost is the same answer and records nothing.
#[test]
fn a_contradicting_completion_is_refused_and_recorded() {
    check(
        "
        0 agent admit r1 k1 model.call start=false reserve=100/10
        1 agent start r1 k1 1.1
        2 agent complete r1 k1 1.1 ok cost=40/4
        3 agent complete r1 k1 1.1 ok cost=40/4
        4 agent complete r1 k1 1.1 ok cost=0/0
        5 agent complete r1 k1 1.1 error cost=40/4
        6 agent cancel r1
        7 agent complete r1 k1 1.1 unknown cost=40/4
        ",
        expect![[r#"
            0 agent admit r1 k1 model.call start=false reserve=100/10 => admitted 1.1
            1 agent start r1 k1 1.1                      => go
            2 agent complete r1 k1 1.1 ok cost=40/4      => completed
            3 agent complete r1 k1 1.1 ok cost=40/4      => completed
            4 agent complete r1 k1 1.1 ok cost=0/0       => disputed settled=completed
            5 agent complete r1 k1 1.1 error cost=40/4   => disputed settled=completed
            6 agent cancel r1                            => run cancelled (1 changed)
            7 agent complete r1 k1 1.1 unknown cost=40/4 => disputed settled=completed
            --
            run r1 cancelled stop=cancelled epoch=2 admitted=1 pending=0 in_flight=0 spent=40/4 reserved=0/0 limit=-/-
              k1 model.call completed disputes=3 reserve=100/10 cost=40/4
        "#]],
    );
}

#[test]
fn approval_hold_approve_then_wait_admits_once() {
    check(
        "
        0 agent admit r1 k1 refund action=approve expiry=100
        1 agent wait r1 k1
        2 alice approve r1 k1
        3 agent wait r1 k1
        4 agent wait r1 k1
        5 agent admit r1 k1 refund action=approve expiry=100
        ",
        expect![[r#"
            0 agent admit r1 k1 refund action=approve expiry=100 => held approval #1 until 100
            1 agent wait r1 k1                           => held approval #1 until 100
            2 alice approve r1 k1                        => decided approved
            3 agent wait r1 k1                           => admitted 1.1
            4 agent wait r1 k1                           => duplicate started
            5 agent admit r1 k1 refund action=approve expiry=100 => duplicate started
            --
            run r1 active epoch=1 admitted=1 pending=0 in_flight=1
              k1 refund started approvers=alice
        "#]],
    );
}

#[test]
fn sibling_write_is_held_while_approval_pending_and_read_proceeds() {
    check(
        "
        0 agent admit r1 a refund action=approve
        1 agent admit r1 b email
        2 agent admit r1 c search class=read
        3 agent admit r1 d email start=false
        4 alice approve r1 a
        5 agent wait r1 b
        6 agent wait r1 a
        ",
        expect![[r#"
            0 agent admit r1 a refund action=approve     => held approval #1 until 1000
            1 agent admit r1 b email                     => held sibling
            2 agent admit r1 c search class=read         => admitted 1.1
            3 agent admit r1 d email start=false         => held sibling
            4 alice approve r1 a                         => decided approved
            5 agent wait r1 b                            => admitted 1.2
            6 agent wait r1 a                            => admitted 1.3
            --
            run r1 active epoch=1 admitted=3 pending=0 in_flight=3
              a refund started approvers=alice
              b email started
              c search started
              d email held(sibling)
        "#]],
    );
}

#[test]
fn sibling_hold_reaches_descendants_and_prepared_start() {
    check(
        "
        0 agent admit parent p1 pay start=false
        1 agent admit child c1 email parent=parent
        2 agent admit parent p2 refund action=approve
        3 agent start parent p1 1.1
        4 agent admit child c2 email parent=parent
        5 alice reject parent p2
        6 agent start parent p1 1.1
        7 agent wait child c2
        ",
        expect![[r#"
            0 agent admit parent p1 pay start=false      => admitted 1.1
            1 agent admit child c1 email parent=parent   => admitted 1.1
            2 agent admit parent p2 refund action=approve => held approval #1 until 1002
            3 agent start parent p1 1.1                  => held sibling
            4 agent admit child c2 email parent=parent   => held sibling
            5 alice reject parent p2                     => decided rejected
            6 agent start parent p1 1.1                  => go
            7 agent wait child c2                        => admitted 1.2
            --
            run child active epoch=1 admitted=2 pending=0 in_flight=2 parent=parent
              c1 email started
              c2 email started
            run parent active epoch=1 admitted=1 pending=0 in_flight=1
              p1 pay started
              p2 refund refused(rejected)
        "#]],
    );
}

#[test]
fn reject_sticks_across_retry_and_new_key() {
    check(
        "
        0 agent admit r1 k1 refund arg=100 action=approve
        1 alice reject r1 k1
        2 agent admit r1 k1 refund arg=100 action=approve
        3 agent wait r1 k1
        4 agent admit r1 k2 refund arg=100 action=approve
        5 agent admit r1 k3 refund arg=5 action=approve
        6 alice approve r1 k1
        ",
        expect![[r#"
            0 agent admit r1 k1 refund arg=100 action=approve => held approval #1 until 1000
            1 alice reject r1 k1                         => decided rejected
            2 agent admit r1 k1 refund arg=100 action=approve => refused rejected
            3 agent wait r1 k1                           => refused rejected
            4 agent admit r1 k2 refund arg=100 action=approve => refused rejected
            5 agent admit r1 k3 refund arg=5 action=approve => held approval #2 until 1005
            6 alice approve r1 k1                        => error not_awaiting_approval: effect k1 of run r1 is not awaiting approval (it is rejected)
            --
            run r1 active epoch=1 admitted=0 pending=1 in_flight=0
              k1 refund refused(rejected)
              k2 refund refused(rejected)
              k3 refund held(approval)
        "#]],
    );
}

#[test]
fn quorum_needs_distinct_principals() {
    check(
        "
        0 agent admit r1 k1 refund action=approve quorum=2
        1 alice approve r1 k1
        2 alice approve r1 k1
        3 agent wait r1 k1
        4 bob approve r1 k1
        5 agent wait r1 k1
        ",
        expect![[r#"
            0 agent admit r1 k1 refund action=approve quorum=2 => held approval #1 until 1000
            1 alice approve r1 k1                        => decided pending 1/2
            2 alice approve r1 k1                        => error duplicate_approver: alice has already approved effect k1 of run r1; a quorum needs distinct approvers
            3 agent wait r1 k1                           => held approval #1 until 1000
            4 bob approve r1 k1                          => decided approved
            5 agent wait r1 k1                           => admitted 1.1
            --
            run r1 active epoch=1 admitted=1 pending=0 in_flight=1
              k1 refund started approvers=alice,bob
        "#]],
    );
}

#[test]
fn quorum_groups_need_one_approver_from_each() {
    check(
        "
        0 agent admit r1 k1 refund action=approve quorum=2 groups=finance,ops
        1 alice approve r1 k1
        2 carol approve r1 k1
        3 bob approve r1 k1
        4 agent admit r1 k2 refund arg=x action=approve quorum=2 groups=finance,ops
        5 dave approve r1 k2
        6 carol approve r1 k2
        ",
        expect![[r#"
            0 agent admit r1 k1 refund action=approve quorum=2 groups=finance,ops => held approval #1 until 1000
            1 alice approve r1 k1                        => decided pending 1/2 missing finance,ops
            2 carol approve r1 k1                        => decided pending 2/2 missing ops
            3 bob approve r1 k1                          => decided approved
            4 agent admit r1 k2 refund arg=x action=approve quorum=2 groups=finance,ops => held approval #2 until 1004
            5 dave approve r1 k2                         => decided pending 1/2
            6 carol approve r1 k2                        => decided approved
            --
            run r1 active epoch=1 admitted=0 pending=0 in_flight=0
              k1 refund approved approvers=alice,carol,bob
              k2 refund approved approvers=dave,carol
        "#]],
    );
}

#[test]
fn agent_cannot_decide_pause_resume_or_kill() {
    check(
        "
        0 agent admit r1 k1 refund action=approve
        1 agent approve r1 k1
        2 agent pause r1
        3 agent resume r1
        4 agent kill r1
        ",
        expect![[r#"
            0 agent admit r1 k1 refund action=approve    => held approval #1 until 1000
            1 agent approve r1 k1                        => error forbidden: operation requires the operator role
            2 agent pause r1                             => error forbidden: operation requires the operator role
            3 agent resume r1                            => error forbidden: operation requires the operator role
            4 agent kill r1                              => error forbidden: operation requires the operator role
            --
            run r1 active epoch=1 admitted=0 pending=1 in_flight=0
              k1 refund held(approval)
        "#]],
    );
}

#[test]
fn an_observer_changes_nothing() {
    check(
        "
        0 agent admit r1 k1 refund action=approve
        1 olive approve r1 k1
        2 olive wait r1 k1
        3 olive cancel r1
        4 olive cancel unseen
        5 olive pause r1
        6 olive admit r2 k1 search class=read
        7 olive close r1
        8 olive token_create eve role=operator
        ",
        expect![[r#"
            0 agent admit r1 k1 refund action=approve    => held approval #1 until 1000
            1 olive approve r1 k1                        => error forbidden: operation requires the operator role
            2 olive wait r1 k1                           => error forbidden: operation requires the operator role
            3 olive cancel r1                            => error forbidden: operation requires the operator role
            4 olive cancel unseen                        => error forbidden: operation requires the operator role
            5 olive pause r1                             => error forbidden: operation requires the operator role
            6 olive admit r2 k1 search class=read        => error forbidden: operation requires the operator role
            7 olive close r1                             => error forbidden: operation requires the operator role
            8 olive token_create eve role=operator       => error forbidden: operation requires the operator role
            --
            run r1 active epoch=1 admitted=0 pending=1 in_flight=0
              k1 refund held(approval)
        "#]],
    );
}

/// An executor runs the reverse saga's attempts, of any principal's run, and changes nothing
/// else: no admission, decision, stop, wait or token change.
#[test]
fn an_executor_runs_compensations_and_nothing_else() {
    check(
        "
        0 agent admit r1 k1 refund comp=unrefund
        1 agent complete r1 k1 1.1 ok
        2 agent admit r1 k2 wire action=approve
        3 xena admit r2 k1 search class=read
        4 xena approve r1 k2
        5 xena wait r1 k2
        6 xena cancel r1
        7 xena pause r1
        8 xena close r1
        9 xena token_create eve role=operator
        10 alice cancel r1
        11 xena begin r1 k1 1
        12 xena end r1 k1 1 ok
        ",
        expect![[r#"
            0 agent admit r1 k1 refund comp=unrefund     => admitted 1.1
            1 agent complete r1 k1 1.1 ok                => completed
            2 agent admit r1 k2 wire action=approve      => held approval #1 until 1002
            3 xena admit r2 k1 search class=read         => error forbidden: operation requires the operator role
            4 xena approve r1 k2                         => error forbidden: operation requires the operator role
            5 xena wait r1 k2                            => error forbidden: operation requires the operator role
            6 xena cancel r1                             => error forbidden: operation requires the operator role
            7 xena pause r1                              => error forbidden: operation requires the operator role
            8 xena close r1                              => error forbidden: operation requires the operator role
            9 xena token_create eve role=operator        => error forbidden: operation requires the operator role
            10 alice cancel r1                           => run finalizing (1 changed)
            11 xena begin r1 k1 1                        => compensation compensating attempt=1
            12 xena end r1 k1 1 ok                       => compensation compensated attempt=1
            --
            run r1 cancelled stop=cancelled epoch=2 admitted=1 pending=0 in_flight=0
              k1 refund compensated undo=unrefund attempts=1/5
              k2 wire refused(cancelled)
        "#]],
    );
}

#[test]
fn only_operators_record_token_changes_and_they_change_no_run() {
    check(
        "
        0 agent admit r1 k1 search class=read
        1 alice token_create eve role=operator groups=finance,ops
        2 bob token_revoke eve role=operator groups=finance,ops
        3 agent token_create mallory role=operator
        4 agent token_revoke alice role=operator
        ",
        expect![[r#"
            0 agent admit r1 k1 search class=read        => admitted 1.1
            1 alice token_create eve role=operator groups=finance,ops => token recorded
            2 bob token_revoke eve role=operator groups=finance,ops => token recorded
            3 agent token_create mallory role=operator   => error forbidden: operation requires the operator role
            4 agent token_revoke alice role=operator     => error forbidden: operation requires the operator role
            --
            run r1 active epoch=1 admitted=1 pending=0 in_flight=1
              k1 search started
        "#]],
    );
}

#[test]
fn runs_of_other_agents_are_invisible() {
    check(
        "
        0 agent admit r1 k1 pay
        1 agent2 admit r1 k2 pay
        2 agent2 cancel r1
        3 agent2 wait r1 k1
        4 agent2 admit r2 k1 pay parent=r1
        ",
        expect![[r#"
            0 agent admit r1 k1 pay                      => admitted 1.1
            1 agent2 admit r1 k2 pay                     => error not_found: run r1 not found
            2 agent2 cancel r1                           => error not_found: run r1 not found
            3 agent2 wait r1 k1                          => error not_found: run r1 not found
            4 agent2 admit r2 k1 pay parent=r1           => error not_found: run r1 not found
            --
            run r1 active epoch=1 admitted=1 pending=0 in_flight=1
              k1 pay started
        "#]],
    );
}

#[test]
fn expired_approval_is_a_refusal() {
    check(
        "
        0 agent admit r1 k1 refund action=approve expiry=100
        100 alice approve r1 k1
        100 agent wait r1 k1
        101 agent admit r1 k2 refund action=approve expiry=100
        150 alice approve r1 k2
        300 agent wait r1 k2
        301 agent admit r1 k3 refund arg=z action=approve expiry=100
        401 agent tick r1
        ",
        expect![[r#"
            0 agent admit r1 k1 refund action=approve expiry=100 => held approval #1 until 100
            100 alice approve r1 k1                      => error not_awaiting_approval: effect k1 of run r1 is not awaiting approval (it is expired)
            100 agent wait r1 k1                         => refused expired
            101 agent admit r1 k2 refund action=approve expiry=100 => held approval #2 until 201
            150 alice approve r1 k2                      => decided approved
            300 agent wait r1 k2                         => refused expired
            301 agent admit r1 k3 refund arg=z action=approve expiry=100 => held approval #3 until 401
            401 agent tick r1                            => run active (1 changed)
            --
            run r1 active epoch=1 admitted=0 pending=0 in_flight=0
              k1 refund refused(expired)
              k2 refund refused(expired) approvers=alice
              k3 refund refused(expired)
        "#]],
    );
}

#[test]
fn cancel_fences_run_and_descendants() {
    check(
        "
        0 agent admit root a pay start=false
        1 agent admit child c pay parent=root
        2 agent admit root b refund action=approve
        3 agent admit child d pay start=false
        4 alice cancel root
        5 agent start root a 1.1
        6 agent admit root e pay
        7 agent admit child f pay
        8 agent admit grandchild g pay parent=child
        9 alice approve root b
        10 agent complete child c 1.1 ok
        11 agent cancel root
        ",
        expect![[r#"
            0 agent admit root a pay start=false         => admitted 1.1
            1 agent admit child c pay parent=root        => admitted 1.1
            2 agent admit root b refund action=approve   => held approval #1 until 1002
            3 agent admit child d pay start=false        => held sibling
            4 alice cancel root                          => run cancelled (2 changed)
            5 agent start root a 1.1                     => refused cancelled
            6 agent admit root e pay                     => refused cancelled
            7 agent admit child f pay                    => refused cancelled
            8 agent admit grandchild g pay parent=child  => refused cancelled
            9 alice approve root b                       => error not_awaiting_approval: effect b of run root is not awaiting approval (it is cancelled)
            10 agent complete child c 1.1 ok             => completed late
            11 agent cancel root                         => run cancelled (0 changed)
            --
            run child cancelled stop=cancelled from=root epoch=2 admitted=1 pending=0 in_flight=0 parent=root
              c pay completed late
              d pay refused(cancelled)
            run grandchild cancelled stop=cancelled from=root epoch=2 admitted=0 pending=0 in_flight=0 parent=child
            run root cancelled stop=cancelled epoch=2 admitted=1 pending=0 in_flight=0
              a pay refused(cancelled)
              b refund refused(cancelled)
        "#]],
    );
}

#[test]
fn cancel_before_first_admit_fences_the_run() {
    check(
        "
        0 alice cancel r9
        1 agent admit r9 k1 pay
        2 agent2 admit r9 k1 pay
        ",
        expect![[r#"
            0 alice cancel r9                            => run cancelled (1 changed)
            1 agent admit r9 k1 pay                      => refused cancelled
            2 agent2 admit r9 k1 pay                     => refused cancelled
            --
            run r9 cancelled stop=cancelled epoch=2 admitted=0 pending=0 in_flight=0
        "#]],
    );
}

#[test]
fn late_completion_after_cancel_is_kept_and_flagged() {
    check(
        "
        0 agent admit r1 k1 pay
        1 agent admit r1 k2 pay start=false
        2 agent cancel r1
        3 agent complete r1 k1 1.1 ok
        4 agent complete r1 k2 1.2 ok
        5 agent admit r1 k1 pay
        ",
        expect![[r#"
            0 agent admit r1 k1 pay                      => admitted 1.1
            1 agent admit r1 k2 pay start=false          => admitted 1.2
            2 agent cancel r1                            => run finalizing (1 changed)
            3 agent complete r1 k1 1.1 ok                => completed late
            4 agent complete r1 k2 1.2 ok                => completed late
            5 agent admit r1 k1 pay                      => duplicate completed ok
            --
            run r1 cancelled stop=cancelled epoch=2 admitted=2 pending=0 in_flight=0
              k1 pay completed late
              k2 pay refused(cancelled) late
        "#]],
    );
}

#[test]
fn pause_holds_admits_and_starts_resume_releases() {
    check(
        "
        0 agent admit r1 k0 pay start=false
        1 alice pause r1
        2 agent admit r1 k1 pay
        3 agent start r1 k0 1.1
        4 agent admit r1 k2 search class=read
        5 alice pause r1
        6 alice resume r1
        7 agent wait r1 k1
        8 agent start r1 k0 1.1
        9 alice resume r1
        ",
        expect![[r#"
            0 agent admit r1 k0 pay start=false          => admitted 1.1
            1 alice pause r1                             => run paused (1 changed)
            2 agent admit r1 k1 pay                      => held paused
            3 agent start r1 k0 1.1                      => held paused
            4 agent admit r1 k2 search class=read        => held paused
            5 alice pause r1                             => run paused (0 changed)
            6 alice resume r1                            => run active (1 changed)
            7 agent wait r1 k1                           => admitted 1.2
            8 agent start r1 k0 1.1                      => go
            9 alice resume r1                            => run active (0 changed)
            --
            run r1 active epoch=1 admitted=2 pending=0 in_flight=2
              k0 pay started
              k1 pay started
              k2 search held(paused)
        "#]],
    );
}

#[test]
fn deadline_fences_like_a_cancel() {
    check(
        "
        0 agent admit r1 k1 pay deadline=100 start=false
        1 agent admit r1 k2 refund action=approve
        50 agent admit r1 k3 pay
        100 agent admit r1 k4 pay
        101 agent start r1 k1 1.1
        102 agent admit r1 k5 pay
        ",
        expect![[r#"
            0 agent admit r1 k1 pay deadline=100 start=false => admitted 1.1
            1 agent admit r1 k2 refund action=approve    => held approval #1 until 1001
            50 agent admit r1 k3 pay                     => held sibling
            100 agent admit r1 k4 pay                    => refused deadline
            101 agent start r1 k1 1.1                    => refused deadline
            102 agent admit r1 k5 pay                    => refused deadline
            --
            run r1 cancelled stop=deadline epoch=2 admitted=1 pending=0 in_flight=0
              k1 pay refused(deadline)
              k2 refund refused(deadline)
              k3 pay refused(deadline)
              k4 pay refused(deadline)
        "#]],
    );
}

#[test]
fn deadline_of_an_ancestor_fences_the_child() {
    check(
        "
        0 agent admit root a pay deadline=100
        1 agent admit child b pay parent=root
        100 agent tick root
        101 agent admit child c pay
        ",
        expect![[r#"
            0 agent admit root a pay deadline=100        => admitted 1.1
            1 agent admit child b pay parent=root        => admitted 1.1
            100 agent tick root                          => run finalizing (2 changed)
            101 agent admit child c pay                  => refused deadline
            --
            run child finalizing stop=deadline from=root epoch=2 admitted=1 pending=0 in_flight=1 parent=root
              b pay started
            run root finalizing stop=deadline epoch=2 admitted=1 pending=0 in_flight=1
              a pay started
        "#]],
    );
}

#[test]
fn effect_budget_fences_the_run() {
    check(
        "
        0 agent admit r1 k1 pay max=2
        1 agent admit r1 k2 pay
        2 agent admit r1 k3 pay
        3 agent admit r1 k4 search class=read
        ",
        expect![[r#"
            0 agent admit r1 k1 pay max=2                => admitted 1.1
            1 agent admit r1 k2 pay                      => admitted 1.2
            2 agent admit r1 k3 pay                      => refused budget
            3 agent admit r1 k4 search class=read        => refused budget
            --
            run r1 finalizing stop=budget epoch=2 admitted=2 pending=0 in_flight=2
              k1 pay started
              k2 pay started
              k3 pay refused(budget)
        "#]],
    );
}

#[test]
fn deny_is_recorded_and_sticks() {
    check(
        "
        0 agent admit r1 k1 drop_table action=deny
        1 agent admit r1 k1 drop_table action=deny
        ",
        expect![[r#"
            0 agent admit r1 k1 drop_table action=deny   => refused denied
            1 agent admit r1 k1 drop_table action=deny   => refused denied
            --
            run r1 active epoch=1 admitted=0 pending=0 in_flight=0
              k1 drop_table refused(denied)
        "#]],
    );
}

#[test]
fn close_completes_and_finalizes_after_in_flight() {
    check(
        "
        0 agent admit r1 k1 pay
        1 agent admit r1 k2 email action=approve
        2 agent close r1
        3 agent admit r1 k3 pay
        4 agent complete r1 k1 1.1 unknown
        5 agent complete r1 k1 1.1 ok
        6 agent admit r2 k1 pay
        7 agent fail r2
        ",
        expect![[r#"
            0 agent admit r1 k1 pay                      => admitted 1.1
            1 agent admit r1 k2 email action=approve     => held approval #1 until 1001
            2 agent close r1                             => run finalizing (1 changed)
            3 agent admit r1 k3 pay                      => refused closed
            4 agent complete r1 k1 1.1 unknown           => completed late
            5 agent complete r1 k1 1.1 ok                => completed late
            6 agent admit r2 k1 pay                      => admitted 1.1
            7 agent fail r2                              => run finalizing (1 changed)
            --
            run r1 completed stop=closed epoch=2 admitted=1 pending=0 in_flight=0
              k1 pay completed late
              k2 email refused(closed)
            run r2 finalizing stop=failed epoch=2 admitted=1 pending=0 in_flight=1
              k1 pay started
        "#]],
    );
}

#[test]
fn deciding_what_is_not_awaiting_approval_is_an_error() {
    check(
        "
        0 agent admit r1 a refund action=approve
        1 agent admit r1 b email
        2 alice approve r1 b
        3 alice approve r1 zz
        4 alice approve r2 a
        5 alice approve r1 a
        6 alice approve r1 a
        7 bob reject r1 a
        ",
        expect![[r#"
            0 agent admit r1 a refund action=approve     => held approval #1 until 1000
            1 agent admit r1 b email                     => held sibling
            2 alice approve r1 b                         => error not_awaiting_approval: effect b of run r1 is not awaiting approval (it is held behind a sibling)
            3 alice approve r1 zz                        => error not_found: effect zz of run r1 not found
            4 alice approve r2 a                         => error not_found: run r2 not found
            5 alice approve r1 a                         => decided approved
            6 alice approve r1 a                         => error not_awaiting_approval: effect a of run r1 is not awaiting approval (it is approved)
            7 bob reject r1 a                            => error not_awaiting_approval: effect a of run r1 is not awaiting approval (it is approved)
            --
            run r1 active epoch=1 admitted=0 pending=0 in_flight=0
              a refund approved approvers=alice
              b email held(sibling)
        "#]],
    );
}

#[test]
fn bounds_are_typed_refusals() {
    check(
        "
        0 agent admit r1 a refund arg=1 action=approve
        0 agent admit r1 b refund arg=2 action=approve
        0 agent admit r1 c refund arg=3 action=approve
        0 agent admit r1 d refund arg=4 action=approve
        0 agent admit r1 e refund arg=5 action=approve
        ",
        expect![[r#"
            0 agent admit r1 a refund arg=1 action=approve => held approval #1 until 1000
            0 agent admit r1 b refund arg=2 action=approve => held approval #2 until 1000
            0 agent admit r1 c refund arg=3 action=approve => held approval #3 until 1000
            0 agent admit r1 d refund arg=4 action=approve => held approval #4 until 1000
            0 agent admit r1 e refund arg=5 action=approve => error limit: limit reached: pending_approvals_per_run_max = 4
            --
            run r1 active epoch=1 admitted=0 pending=4 in_flight=0
              a refund held(approval)
              b refund held(approval)
              c refund held(approval)
              d refund held(approval)
        "#]],
    );
}

#[test]
fn complete_without_start_is_an_error() {
    check(
        "
        0 agent admit r1 k1 pay start=false
        1 agent complete r1 k1 1.1 ok
        2 agent complete r1 k1 7.7 ok
        3 agent complete r1 nope 1.1 ok
        ",
        expect![[r#"
            0 agent admit r1 k1 pay start=false          => admitted 1.1
            1 agent complete r1 k1 1.1 ok                => error not_started: effect k1 of run r1 was not started (call start first)
            2 agent complete r1 k1 7.7 ok                => error bad_token: the token does not belong to effect k1 of run r1
            3 agent complete r1 nope 1.1 ok              => error not_found: effect nope of run r1 not found
            --
            run r1 active epoch=1 admitted=1 pending=0 in_flight=0
              k1 pay admitted
        "#]],
    );
}

#[test]
fn retention_forgets_stopped_runs_and_their_fences_stay_until_their_own_retention() {
    check(
        "
        0 agent admit r1 k1 pay
        1 agent complete r1 k1 1.1 ok
        2 agent cancel r1
        3 agent admit r2 k1 pay
        4 agent admit c1 k1 pay parent=r1
        5 agent close r2
        10 agent compact 5
        11 agent admit r1 k1 pay
        12 agent admit r1 k9 pay
        13 agent admit kid k pay parent=r1
        14 agent2 admit r1 k pay
        15 agent start r1 k1 1.1
        16 agent complete r1 k1 1.1 ok
        17 agent wait r1 k1
        18 alice approve r1 k1
        19 alice pause r1
        20 alice cancel r1
        21 agent close r1
        22 agent2 cancel r1
        23 agent kill r1
        24 agent complete r2 k1 1.1 ok
        30 agent compact 25
        31 agent admit r2 k2 pay
        32 agent admit kid2 k pay parent=orphan
        33 agent admit orphan k pay parent=r2
        40 agent compact 35 12
        41 agent admit r1 k1 pay
        ",
        expect![[r#"
            0 agent admit r1 k1 pay                      => admitted 1.1
            1 agent complete r1 k1 1.1 ok                => completed
            2 agent cancel r1                            => run cancelled (1 changed)
            3 agent admit r2 k1 pay                      => admitted 1.1
            4 agent admit c1 k1 pay parent=r1            => refused cancelled
            5 agent close r2                             => run finalizing (1 changed)
            10 agent compact 5                           => forgot 2 runs, dropped 0 tombstones
            11 agent admit r1 k1 pay                     => refused cancelled
            12 agent admit r1 k9 pay                     => refused cancelled
            13 agent admit kid k pay parent=r1           => refused cancelled
            14 agent2 admit r1 k pay                     => error not_found: run r1 not found
            15 agent start r1 k1 1.1                     => refused cancelled
            16 agent complete r1 k1 1.1 ok               => error not_found: run r1 was forgotten after its retention period (only its fence is kept: see status); complete has nothing left to act on
            17 agent wait r1 k1                          => refused cancelled
            18 alice approve r1 k1                       => error not_found: run r1 was forgotten after its retention period (only its fence is kept: see status); decide has nothing left to act on
            19 alice pause r1                            => error invalid_state: run r1 is cancelled: pause is not possible
            20 alice cancel r1                           => run cancelled (0 changed)
            21 agent close r1                            => run cancelled (0 changed)
            22 agent2 cancel r1                          => error not_found: run r1 not found
            23 agent kill r1                             => error forbidden: operation requires the operator role
            24 agent complete r2 k1 1.1 ok               => completed late
            30 agent compact 25                          => forgot 2 runs, dropped 0 tombstones
            31 agent admit r2 k2 pay                     => refused closed
            32 agent admit kid2 k pay parent=orphan      => admitted 1.1
            33 agent admit orphan k pay parent=r2        => refused closed
            40 agent compact 35 12                       => forgot 1 runs, dropped 3 tombstones
            41 agent admit r1 k1 pay                     => admitted 1.1
            --
            run kid2 finalizing stop=closed from=orphan epoch=2 admitted=1 pending=0 in_flight=1 parent=orphan
              k pay started
            run r1 active epoch=1 admitted=1 pending=0 in_flight=1
              k1 pay started
            tombstone kid cancelled stop=cancelled at=13 epoch=2 owner=agent
            tombstone orphan completed stop=closed at=33 epoch=2 owner=agent
        "#]],
    );
}

#[test]
fn per_principal_shares_of_runs_and_held_effects_and_the_operator_reserve() {
    check(
        "
        limits runs_max=7 runs_per_principal_max=3 held_max=3 held_per_principal_max=2
        0 agent admit a1 k pay
        1 agent admit a2 k pay
        2 agent admit a3 k pay
        3 agent admit a4 k pay
        4 agent2 admit b1 k pay
        5 agent2 admit b2 k pay parent=b0
        6 agent2 admit b3 k pay
        7 alice cancel x1
        8 alice cancel x2
        10 agent admit a1 h1 refund action=approve
        11 agent admit a1 h2 email
        12 agent admit a2 h3 refund action=approve
        13 agent admit fresh h refund action=approve
        14 agent2 admit b1 h1 refund action=approve
        15 agent2 admit b1 h2 refund arg=2 action=approve
        16 alice reject a1 h1
        17 agent wait a1 h2
        18 agent admit a2 h3 refund action=approve
        19 agent cancel a2
        ",
        expect![[r#"
            limits runs_max=7 runs_per_principal_max=3 held_max=3 held_per_principal_max=2
            0 agent admit a1 k pay                       => admitted 1.1
            1 agent admit a2 k pay                       => admitted 1.1
            2 agent admit a3 k pay                       => admitted 1.1
            3 agent admit a4 k pay                       => error limit: limit reached: runs_per_principal_max = 3; this principal holds that many runs: close or cancel those that are done (a stopped run is forgotten after the retention period), or raise --runs-per-principal-max
            4 agent2 admit b1 k pay                      => admitted 1.1
            5 agent2 admit b2 k pay parent=b0            => admitted 1.1
            6 agent2 admit b3 k pay                      => error limit: limit reached: runs_max = 7; the rest is reserved for operators (1%): close or cancel runs that are done, a stopped run is forgotten after the retention period
            7 alice cancel x1                            => run cancelled (1 changed)
            8 alice cancel x2                            => error limit: limit reached: runs_max = 7; close or cancel runs that are done: a stopped run is forgotten after the retention period (estop serve --retention), or raise --runs-max
            10 agent admit a1 h1 refund action=approve   => held approval #1 until 1010
            11 agent admit a1 h2 email                   => held sibling
            12 agent admit a2 h3 refund action=approve   => error limit: limit reached: held_per_principal_max = 2; wait for held effects to be decided, expire or be cancelled before proposing more
            13 agent admit fresh h refund action=approve => error limit: limit reached: held_per_principal_max = 2; wait for held effects to be decided, expire or be cancelled before proposing more
            14 agent2 admit b1 h1 refund action=approve  => held approval #1 until 1014
            15 agent2 admit b1 h2 refund arg=2 action=approve => error limit: limit reached: held_max = 3; wait for held effects to be decided, expire or be cancelled before proposing more
            16 alice reject a1 h1                        => decided rejected
            17 agent wait a1 h2                          => admitted 1.2
            18 agent admit a2 h3 refund action=approve   => held approval #1 until 1018
            19 agent cancel a2                           => run finalizing (1 changed)
            --
            run a1 active epoch=1 admitted=2 pending=0 in_flight=2
              h1 refund refused(rejected)
              h2 email started
              k pay started
            run a2 finalizing stop=cancelled epoch=2 admitted=1 pending=0 in_flight=1
              h3 refund refused(cancelled)
              k pay started
            run a3 active epoch=1 admitted=1 pending=0 in_flight=1
              k pay started
            run b0 active epoch=1 admitted=0 pending=0 in_flight=0
            run b1 active epoch=1 admitted=1 pending=1 in_flight=1
              h1 refund held(approval)
              k pay started
            run b2 active epoch=1 admitted=1 pending=0 in_flight=1 parent=b0
              k pay started
            run x1 cancelled stop=cancelled epoch=2 admitted=0 pending=0 in_flight=0
            held 1
            usage agent runs=3 held=0
            usage agent2 runs=3 held=1
        "#]],
    );
}

#[test]
fn at_the_tombstone_bound_stopped_runs_keep_their_state_rather_than_lose_their_fence() {
    check(
        "
        limits runs_max=4 tombstones_max=1
        0 agent admit r1 k pay start=false
        1 agent close r1
        2 agent admit r2 k pay start=false
        3 agent close r2
        4 agent admit r3 k pay start=false
        5 agent admit r4 k pay
        10 agent compact 5
        11 agent admit r2 k2 pay
        12 alice cancel x
        13 alice cancel y
        14 alice cancel z
        20 agent compact 5 2
        21 alice cancel r1
        ",
        expect![[r#"
            limits runs_max=4 tombstones_max=1
            0 agent admit r1 k pay start=false           => admitted 1.1
            1 agent close r1                             => run completed (1 changed)
            2 agent admit r2 k pay start=false           => admitted 1.1
            3 agent close r2                             => run completed (1 changed)
            4 agent admit r3 k pay start=false           => admitted 1.1
            5 agent admit r4 k pay                       => error limit: limit reached: runs_max = 4; the rest is reserved for operators (1%): close or cancel runs that are done, a stopped run is forgotten after the retention period
            10 agent compact 5                           => forgot 1 runs, dropped 0 tombstones
            11 agent admit r2 k2 pay                     => refused closed
            12 alice cancel x                            => run cancelled (1 changed)
            13 alice cancel y                            => run cancelled (1 changed)
            14 alice cancel z                            => error limit: limit reached: tombstones_max = 1; every stopped run waits for room to leave its fence as a tombstone, so none is forgotten: raise --tombstones-max or shorten --tombstone-retention
            20 agent compact 5 2                         => forgot 1 runs, dropped 1 tombstones
            21 alice cancel r1                           => run cancelled (1 changed)
            --
            run r1 cancelled stop=cancelled epoch=2 admitted=0 pending=0 in_flight=0
            run r3 active epoch=1 admitted=1 pending=0 in_flight=0
              k pay admitted
            run x cancelled stop=cancelled epoch=2 admitted=0 pending=0 in_flight=0
            run y cancelled stop=cancelled epoch=2 admitted=0 pending=0 in_flight=0
            tombstone r2 completed stop=closed at=3 epoch=2 owner=agent
            held 0
            usage agent runs=1 held=0
        "#]],
    );
}

// Postmortem (found by the model checker in crates/sim, property P3): `start` re-checked fence,
// deadline, pause and sibling but not the run's rejected digests, so an effect prepared
// (admitted, start=false) before an operator rejected the same call under another key could
// still get `go` afterwards — the rejected call ran.
#[test]
fn regression_start_of_a_call_rejected_after_it_was_prepared_is_refused() {
    check(
        "
        0 agent admit r1 b refund start=false action=approve
        1 alice approve r1 b
        2 agent wait r1 b
        3 agent admit r1 a refund action=approve
        4 alice reject r1 a
        5 agent start r1 b 1.1
        6 agent start r1 b 1.1
        7 agent complete r1 b 1.1 ok
        ",
        expect![[r#"
            0 agent admit r1 b refund start=false action=approve => held approval #1 until 1000
            1 alice approve r1 b                         => decided approved
            2 agent wait r1 b                            => admitted 1.1
            3 agent admit r1 a refund action=approve     => held approval #2 until 1003
            4 alice reject r1 a                          => decided rejected
            5 agent start r1 b 1.1                       => refused rejected
            6 agent start r1 b 1.1                       => refused rejected
            7 agent complete r1 b 1.1 ok                 => completed late
            --
            run r1 active epoch=1 admitted=1 pending=0 in_flight=0
              a refund refused(rejected)
              b refund refused(rejected) late approvers=alice
        "#]],
    );
}

#[test]
fn a_parent_created_by_its_child_learns_its_own_parent_at_its_first_admit() {
    check(
        "
        0 agent admit grandchild g pay parent=child
        1 agent admit child c pay parent=root
        2 agent admit root r pay
        3 alice cancel root
        4 agent admit grandchild g2 pay
        5 agent admit child c2 pay parent=other
        ",
        expect![[r#"
            0 agent admit grandchild g pay parent=child  => admitted 1.1
            1 agent admit child c pay parent=root        => admitted 1.1
            2 agent admit root r pay                     => admitted 1.1
            3 alice cancel root                          => run finalizing (3 changed)
            4 agent admit grandchild g2 pay              => refused cancelled
            5 agent admit child c2 pay parent=other      => refused cancelled
            --
            run child finalizing stop=cancelled from=root epoch=2 admitted=1 pending=0 in_flight=1 parent=root
              c pay started
            run grandchild finalizing stop=cancelled from=root epoch=2 admitted=1 pending=0 in_flight=1 parent=child
              g pay started
            run root finalizing stop=cancelled epoch=2 admitted=1 pending=0 in_flight=1
              r pay started
        "#]],
    );
}

#[test]
fn adopting_a_stopped_parent_fences_the_subtree_and_cycles_are_refused() {
    check(
        "
        0 agent admit b x pay parent=a
        1 alice cancel top
        2 agent admit a y pay parent=top
        3 agent admit b z pay
        4 agent admit p1 k pay parent=p2
        5 agent admit p2 k pay parent=p1
        6 agent admit p1 k2 pay parent=zz
        7 agent admit solo k pay
        8 agent admit solo k2 pay parent=p1
        ",
        expect![[r#"
            0 agent admit b x pay parent=a               => admitted 1.1
            1 alice cancel top                           => run cancelled (1 changed)
            2 agent admit a y pay parent=top             => refused cancelled
            3 agent admit b z pay                        => refused cancelled
            4 agent admit p1 k pay parent=p2             => admitted 1.1
            5 agent admit p2 k pay parent=p1             => error parent_mismatch: run p2 already has parent none, not p1
            6 agent admit p1 k2 pay parent=zz            => error parent_mismatch: run p1 already has parent p2, not zz
            7 agent admit solo k pay                     => admitted 1.1
            8 agent admit solo k2 pay parent=p1          => error parent_mismatch: run solo already has parent none, not p1
            --
            run a cancelled stop=cancelled epoch=2 admitted=0 pending=0 in_flight=0 parent=top
            run b finalizing stop=cancelled from=a epoch=2 admitted=1 pending=0 in_flight=1 parent=a
              x pay started
            run p1 active epoch=1 admitted=1 pending=0 in_flight=1 parent=p2
              k pay started
            run p2 active epoch=1 admitted=0 pending=0 in_flight=0
            run solo active epoch=1 admitted=1 pending=0 in_flight=1
              k pay started
            run top cancelled stop=cancelled epoch=2 admitted=0 pending=0 in_flight=0
        "#]],
    );
}

/// Tool and rule names are stored once for all the effects that use them (memory per identity).
#[test]
fn tool_and_rule_names_are_shared_between_effects_and_survive_a_snapshot() {
    use estop_kernel::record_codec::{decode_snapshot, encode_snapshot};
    use estop_kernel::{Gate, Limits, RunId};
    let mut gate = Gate::new(Limits::default());
    for line in [
        "0 agent admit r1 a pay",
        "1 agent admit r1 b pay arg=2",
        "2 agent admit r2 c pay",
    ] {
        let rec = support::parse_line(line, None);
        gate.apply(rec.at, &rec.principal, &rec.command).unwrap();
    }
    let shared = |g: &Gate| {
        let e = |r: &str, k: &str| {
            let run = g.run(&RunId::new(r).unwrap()).unwrap();
            let eff = &run.effects[&estop_kernel::EffectKey::new(k).unwrap()];
            (
                eff.tool.as_str().as_ptr(),
                std::sync::Arc::as_ptr(&eff.rule),
            )
        };
        let (a, b, c) = (e("r1", "a"), e("r1", "b"), e("r2", "c"));
        a == b && b == c
    };
    assert!(shared(&gate), "names are shared in the live gate");
    let mut snap = Vec::new();
    encode_snapshot(&gate, &mut snap);
    let back = decode_snapshot(&snap, Limits::default()).unwrap();
    assert!(
        shared(&back),
        "names are shared after recovery from a snapshot"
    );
}

/// A version 1 snapshot (before runs were forgotten) still loads: its compacted run is a stopped
/// run without effects, and the next compaction forgets it into a tombstone.
#[test]
fn a_version_1_snapshot_loads_and_its_compacted_runs_are_forgotten_next() {
    use estop_kernel::record_codec::{decode_snapshot, encode_snapshot};
    use estop_kernel::{Command, Limits, RunId};
    let mut v1 = vec![1u8];
    v1.extend_from_slice(&1u64.to_le_bytes()); // one run
    let s = |v: &mut Vec<u8>, t: &str| {
        v.extend_from_slice(&(t.len() as u32).to_le_bytes());
        v.extend_from_slice(t.as_bytes());
    };
    s(&mut v1, "r1");
    v1.push(0); // no parent
    v1.extend_from_slice(&0u32.to_le_bytes()); // no children
    v1.push(1);
    s(&mut v1, "agent");
    v1.extend_from_slice(&0u32.to_le_bytes()); // no labels
    v1.extend_from_slice(&1u64.to_le_bytes()); // created_at
    v1.push(3); // state: completed
    v1.push(1); // stop
    v1.push(4); // cause: closed
    v1.extend_from_slice(&[0, 0]); // no reason, no by
    v1.extend_from_slice(&5u64.to_le_bytes()); // at
    v1.push(0); // not inherited
    v1.extend_from_slice(&2u32.to_le_bytes()); // epoch
    v1.extend_from_slice(&[0, 0]); // no deadline, no max effects
    v1.extend_from_slice(&1u64.to_le_bytes()); // admitted
    v1.extend_from_slice(&[0; 8]); // pending, in flight
    v1.extend_from_slice(&2u64.to_le_bytes()); // next serial
    v1.extend_from_slice(&1u64.to_le_bytes()); // next approval
    v1.push(1); // compacted
    v1.extend_from_slice(&[0; 8]); // no rejected digests, no effects
    let mut gate = decode_snapshot(&v1, Limits::default()).expect("a v1 snapshot loads");
    let r1 = RunId::new("r1").unwrap();
    assert!(gate.run(&r1).unwrap().effects.is_empty());
    let op = support::principal("alice");
    let compact = Command::Compact {
        before: 10,
        tombstones_before: 0,
    };
    let applied = gate.apply(20, &op, &compact).unwrap();
    assert_eq!(
        support::render_reply(&applied.reply),
        "forgot 1 runs, dropped 0 tombstones"
    );
    assert!(gate.run(&r1).is_none());
    assert_eq!(gate.tombstone(&r1).unwrap().stopped_at, 5);
    let mut v2 = Vec::new();
    encode_snapshot(&gate, &mut v2);
    assert_eq!(
        v2[0],
        estop_kernel::record_codec::SNAPSHOT_VERSION,
        "written as the current version"
    );
    assert_eq!(decode_snapshot(&v2, Limits::default()).unwrap(), gate);
    let mut bad = v1.clone();
    bad[0] = estop_kernel::record_codec::SNAPSHOT_VERSION + 1;
    assert!(decode_snapshot(&bad, Limits::default()).is_err());
}

/// Version 2 to 7 snapshots (before compensations, before lookups, before the model budget,
/// before lookup mappings, before holders) still load: their effects have no compensation, no
/// lookup, no spend, no lookup mapping, or are held by the principal's main part. They are the
/// version 8 encoding without those bytes (a compensation is none here, a `0`).
#[test]
fn a_version_2_to_6_snapshot_loads_with_effects_that_have_no_compensation_or_lookup() {
    use estop_kernel::record_codec::{decode_snapshot, encode_snapshot};
    use estop_kernel::{Gate, Limits};
    let mut gate = Gate::new(Limits::default());
    for line in [
        "0 agent admit r1 k1 refund comp=unrefund",
        "1 agent complete r1 k1 1.1 ok",
    ] {
        let rec = support::parse_line(line, None);
        gate.apply(rec.at, &rec.principal, &rec.command).unwrap();
    }
    let mut v8 = Vec::new();
    encode_snapshot(&gate, &mut v8);
    assert_eq!(v8[0], 8);
    // Version 8 ends each effect with its holder (`main`, 0) and its disputes (a u32, 0),
    // before the run's budget (34 bytes) and the 8 bytes of no tombstones; version 7 is the
    // same without those 5 bytes.
    let tail8 = v8.len() - 8;
    assert_eq!(
        v8[tail8 - 39..tail8 - 34],
        [0; 5],
        "held by main, no disputes"
    );
    let mut v7 = v8.clone();
    v7.drain(tail8 - 39..tail8 - 34);
    v7[0] = 7;
    assert_eq!(decode_snapshot(&v7, Limits::default()).unwrap(), gate);
    // Version 6 ends the effect with its spend (none, `0`) and the run with its budget (two
    // absent limits, spent and reserved: 34 bytes), before the 8 bytes of no tombstones. Before
    // them: the effect's `compensate_args` byte (version 3), `lookup` byte (version 4),
    // `lookup_args` byte (version 7) and compensation byte.
    let tail = v7.len() - 8;
    assert_eq!(v7[tail - 35..tail], [0; 35], "no spend, no budget");
    assert_eq!(
        v7[tail - 39..tail - 35],
        [0, 0, 0, 0],
        "no mapping, no lookup, no lookup mapping, no compensation yet"
    );
    let mut v6 = v7.clone();
    v6.remove(tail - 37);
    v6[0] = 6;
    assert_eq!(decode_snapshot(&v6, Limits::default()).unwrap(), gate);
    // Without the spend and the budget it is the version 5 encoding, which is version 4's when
    // no compensation waits.
    let mut v4 = v6.clone();
    v4.drain(tail - 36..tail - 1);
    v4[0] = 4;
    let mut v5 = v4.clone();
    v5[0] = 5;
    assert_eq!(decode_snapshot(&v5, Limits::default()).unwrap(), gate);
    let added = v4.len() - 11;
    assert_eq!(
        v4[added..added + 3],
        [0, 0, 0],
        "no mapping, no lookup, no compensation yet"
    );
    let mut v3 = v4.clone();
    v3.remove(added + 1);
    v3[0] = 3;
    assert_eq!(decode_snapshot(&v3, Limits::default()).unwrap(), gate);
    let mut v2 = v4.clone();
    v2.drain(added..added + 3);
    v2[0] = 2;
    assert_eq!(decode_snapshot(&v2, Limits::default()).unwrap(), gate);
    // Read as a later version, the same bytes lack a field: an error, never a guess.
    v2[0] = 3;
    assert!(decode_snapshot(&v2, Limits::default()).is_err());
    v3[0] = 4;
    assert!(decode_snapshot(&v3, Limits::default()).is_err());
    v6[0] = 7;
    assert!(decode_snapshot(&v6, Limits::default()).is_err());
    v7[0] = 8;
    assert!(decode_snapshot(&v7, Limits::default()).is_err());
}

/// A lookup's mapping (`lookup_args`) is recorded with the admission (tag 20) and kept in the
/// snapshot; an admission with a lookup and no mapping is still written as tag 18.
#[test]
fn a_lookup_mapping_is_recorded_with_the_admission_and_kept_in_the_snapshot() {
    use estop_kernel::record_codec::{
        decode_record, decode_snapshot, encode_record, encode_snapshot,
    };
    use estop_kernel::{Gate, Limits};
    let mut gate = Gate::new(Limits::default());
    let with = support::parse_line(
        r#"0 agent admit r1 k1 http.POST comp=http.DELETE lookup=http.GET largs={"path":"/x/"+key}"#,
        None,
    );
    let without = support::parse_line("1 agent admit r1 k2 refund comp=unrefund lookup=find", None);
    for (rec, tag) in [(&with, 20u8), (&without, 18)] {
        let mut buf = Vec::new();
        encode_record(rec, &mut buf);
        // version, at, principal ("agent": 4 + 5 bytes, role, no groups), then the tag.
        assert_eq!(buf[1 + 8 + 9 + 1 + 4], tag);
        assert_eq!(&decode_record(&buf).unwrap(), rec);
        gate.apply(rec.at, &rec.principal, &rec.command).unwrap();
    }
    let r1 = RunId::new("r1").unwrap();
    let e = &gate.run(&r1).unwrap().effects[&estop_kernel::EffectKey::new("k1").unwrap()];
    assert_eq!(e.lookup_args.as_deref(), Some(r#"{"path":"/x/"+key}"#));
    let mut snap = Vec::new();
    encode_snapshot(&gate, &mut snap);
    assert_eq!(decode_snapshot(&snap, Limits::default()).unwrap(), gate);
}

/// Every verb that moves a run, from every state a run can be in: each either moves it along
/// the table (`transitions::RUN_TRANSITIONS`), changes nothing, or is a typed refusal that
/// changes nothing. Never a panic.
#[test]
fn every_run_verb_from_every_run_state() {
    use estop_kernel::transitions::RUN_TRANSITIONS;
    use support::{parse_line, render_reply};
    // One effect in flight (`k`, token 1.1), then the steps that reach each state.
    let states: [(&str, &[&str]); 6] = [
        ("active", &[]),
        ("paused", &["1 alice pause r1"]),
        ("finalizing", &["1 alice cancel r1"]),
        (
            "completed",
            &["1 agent complete r1 k 1.1 ok", "2 agent close r1"],
        ),
        (
            "failed",
            &["1 agent complete r1 k 1.1 ok", "2 agent fail r1"],
        ),
        (
            "cancelled",
            &["1 agent complete r1 k 1.1 ok", "2 agent cancel r1"],
        ),
    ];
    let verbs = [
        "alice pause r1",
        "alice resume r1",
        "agent cancel r1",
        "alice kill r1",
        "agent close r1",
        "agent fail r1",
        "agent tick r1",
        "agent complete r1 k 1.1 ok",
    ];
    let mut out = String::new();
    for (name, steps) in states {
        let mut gate = Gate::new(Limits::default());
        for line in ["0 agent admit r1 k pay deadline=100"].iter().chain(steps) {
            let rec = parse_line(line, None);
            gate.apply(rec.at, &rec.principal, &rec.command).unwrap();
        }
        let from = gate.run(&RunId::new("r1").unwrap()).unwrap().state;
        assert_eq!(from.as_str(), name);
        for verb in verbs {
            let rec = parse_line(&format!("5 {verb}"), None);
            let mut after = gate.clone();
            let reply = match after.apply(rec.at, &rec.principal, &rec.command) {
                Ok(applied) => render_reply(&applied.reply),
                Err(e) => {
                    assert_eq!(after, gate, "{name}: {verb} failed and changed the state");
                    format!("error {}", e.code())
                }
            };
            let to = after.run(&RunId::new("r1").unwrap()).unwrap().state;
            assert!(
                to == from || RUN_TRANSITIONS.contains(&(from, to)),
                "{name}: {verb} moved it to {to}"
            );
            writeln!(out, "{name:<10} {verb:<27} => {reply:<26} {to}").unwrap();
        }
        // Past the deadline a tick stops it like a cancel.
        let rec = parse_line("200 agent tick r1", None);
        let mut after = gate.clone();
        let reply = render_reply(
            &after
                .apply(rec.at, &rec.principal, &rec.command)
                .unwrap()
                .reply,
        );
        let to = after.run(&RunId::new("r1").unwrap()).unwrap().state;
        assert!(to == from || RUN_TRANSITIONS.contains(&(from, to)));
        writeln!(
            out,
            "{name:<10} {:<27} => {reply:<26} {to}",
            "agent tick r1 (at 200)"
        )
        .unwrap();
    }
    expect![[r#"
        active     alice pause r1              => run paused (1 changed)     paused
        active     alice resume r1             => run active (0 changed)     active
        active     agent cancel r1             => run finalizing (1 changed) finalizing
        active     alice kill r1               => run finalizing (1 changed) finalizing
        active     agent close r1              => run finalizing (1 changed) finalizing
        active     agent fail r1               => run finalizing (1 changed) finalizing
        active     agent tick r1               => run active (0 changed)     active
        active     agent complete r1 k 1.1 ok  => completed                  active
        active     agent tick r1 (at 200)      => run finalizing (1 changed) finalizing
        paused     alice pause r1              => run paused (0 changed)     paused
        paused     alice resume r1             => run active (1 changed)     active
        paused     agent cancel r1             => run finalizing (1 changed) finalizing
        paused     alice kill r1               => run finalizing (1 changed) finalizing
        paused     agent close r1              => run finalizing (1 changed) finalizing
        paused     agent fail r1               => run finalizing (1 changed) finalizing
        paused     agent tick r1               => run paused (0 changed)     paused
        paused     agent complete r1 k 1.1 ok  => completed                  paused
        paused     agent tick r1 (at 200)      => run finalizing (1 changed) finalizing
        finalizing alice pause r1              => error invalid_state        finalizing
        finalizing alice resume r1             => error invalid_state        finalizing
        finalizing agent cancel r1             => run finalizing (0 changed) finalizing
        finalizing alice kill r1               => run finalizing (0 changed) finalizing
        finalizing agent close r1              => run finalizing (0 changed) finalizing
        finalizing agent fail r1               => run finalizing (0 changed) finalizing
        finalizing agent tick r1               => run finalizing (0 changed) finalizing
        finalizing agent complete r1 k 1.1 ok  => completed late             cancelled
        finalizing agent tick r1 (at 200)      => run finalizing (0 changed) finalizing
        completed  alice pause r1              => error invalid_state        completed
        completed  alice resume r1             => error invalid_state        completed
        completed  agent cancel r1             => run completed (0 changed)  completed
        completed  alice kill r1               => run completed (0 changed)  completed
        completed  agent close r1              => run completed (0 changed)  completed
        completed  agent fail r1               => run completed (0 changed)  completed
        completed  agent tick r1               => run completed (0 changed)  completed
        completed  agent complete r1 k 1.1 ok  => completed                  completed
        completed  agent tick r1 (at 200)      => run completed (0 changed)  completed
        failed     alice pause r1              => error invalid_state        failed
        failed     alice resume r1             => error invalid_state        failed
        failed     agent cancel r1             => run failed (0 changed)     failed
        failed     alice kill r1               => run failed (0 changed)     failed
        failed     agent close r1              => run failed (0 changed)     failed
        failed     agent fail r1               => run failed (0 changed)     failed
        failed     agent tick r1               => run failed (0 changed)     failed
        failed     agent complete r1 k 1.1 ok  => completed                  failed
        failed     agent tick r1 (at 200)      => run failed (0 changed)     failed
        cancelled  alice pause r1              => error invalid_state        cancelled
        cancelled  alice resume r1             => error invalid_state        cancelled
        cancelled  agent cancel r1             => run cancelled (0 changed)  cancelled
        cancelled  alice kill r1               => run cancelled (0 changed)  cancelled
        cancelled  agent close r1              => run cancelled (0 changed)  cancelled
        cancelled  agent fail r1               => run cancelled (0 changed)  cancelled
        cancelled  agent tick r1               => run cancelled (0 changed)  cancelled
        cancelled  agent complete r1 k 1.1 ok  => completed                  cancelled
        cancelled  agent tick r1 (at 200)      => run cancelled (0 changed)  cancelled
    "#]]
    .assert_eq(&out);
}

/// `start: true` is the start, also when the effect was prepared before (`start=false`, by
/// anyone holding the same key and arguments): the repeat starts it at the commit point, or is
/// held or refused as `start` would be. Before, it answered the prepared token and started
/// nothing, so a client that asked to start (the egress proxy) ran a call the gate had never
/// seen start: a cancel voided it as never run, and its completion was refused.
#[test]
fn a_repeat_admit_asking_to_start_starts_a_prepared_effect() {
    check(
        "
        0 agent admit r1 k1 pay start=false
        1 agent admit r1 k1 pay
        2 agent complete r1 k1 1.1 ok
        3 agent admit r1 k2 refund action=approve start=false
        4 agent admit r1 k2 refund action=approve
        5 alice approve r1 k2
        6 agent wait r1 k2
        7 agent complete r1 k2 1.2 ok
        8 agent admit r1 k3 pay start=false
        9 alice pause r1
        10 agent admit r1 k3 pay
        11 alice resume r1
        12 agent admit r1 k3 pay
        13 agent admit r1 k4 pay start=false
        14 alice cancel r1
        15 agent admit r1 k4 pay
        ",
        expect![[r#"
            0 agent admit r1 k1 pay start=false          => admitted 1.1
            1 agent admit r1 k1 pay                      => admitted 1.1
            2 agent complete r1 k1 1.1 ok                => completed
            3 agent admit r1 k2 refund action=approve start=false => held approval #1 until 1003
            4 agent admit r1 k2 refund action=approve    => held approval #1 until 1003
            5 alice approve r1 k2                        => decided approved
            6 agent wait r1 k2                           => admitted 1.2
            7 agent complete r1 k2 1.2 ok                => completed
            8 agent admit r1 k3 pay start=false          => admitted 1.3
            9 alice pause r1                             => run paused (1 changed)
            10 agent admit r1 k3 pay                     => held paused
            11 alice resume r1                           => run active (1 changed)
            12 agent admit r1 k3 pay                     => admitted 1.3
            13 agent admit r1 k4 pay start=false         => admitted 1.4
            14 alice cancel r1                           => run finalizing (1 changed)
            15 agent admit r1 k4 pay                     => refused cancelled
            --
            run r1 finalizing stop=cancelled epoch=2 admitted=4 pending=0 in_flight=1
              k1 pay completed
              k2 refund completed approvers=alice
              k3 pay started
              k4 pay refused(cancelled)
        "#]],
    );
}
