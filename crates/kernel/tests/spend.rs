//! The model budget as data: reservations and costs counted on a run and every ancestor, the
//! `budget` refusal naming the dimension and the run, the fence when settled spend reaches a
//! limit, and what a stop does to reservations. Each script is also replayed from its ledger
//! records and from a snapshot (`support::check`), which must rebuild the same spend.

mod support;

use expect_test::expect;
use support::check;

#[test]
fn a_reservation_counts_on_the_run_and_its_ancestors_and_settles_to_its_cost() {
    check(
        "
        0 agent admit root k0 read class=read max_usd=1000 max_tokens=500
        1 agent admit kid k1 model.call parent=root start=false reserve=600/100
        2 agent admit kid k2 model.call parent=root start=false reserve=500/100
        3 agent admit root k3 model.call start=false reserve=400/400 arg=b
        4 agent start kid k1 1.1
        5 agent complete kid k1 1.1 ok cost=100/50
        6 agent admit kid k2 model.call parent=root start=false reserve=500/100
        7 agent admit kid k4 model.call parent=root start=false reserve=500/100 arg=c
        ",
        expect![[r#"
            0 agent admit root k0 read class=read max_usd=1000 max_tokens=500 => admitted 1.1
            1 agent admit kid k1 model.call parent=root start=false reserve=600/100 => admitted 1.1
            2 agent admit kid k2 model.call parent=root start=false reserve=500/100 => refused budget model_usd of root used=600 limit=1000
            3 agent admit root k3 model.call start=false reserve=400/400 arg=b => admitted 1.2
            4 agent start kid k1 1.1                     => go
            5 agent complete kid k1 1.1 ok cost=100/50   => completed
            6 agent admit kid k2 model.call parent=root start=false reserve=500/100 => refused budget
            7 agent admit kid k4 model.call parent=root start=false reserve=500/100 arg=c => refused budget model_tokens of root used=450 limit=500
            --
            run kid active epoch=1 admitted=1 pending=0 in_flight=0 parent=root spent=100/50 reserved=0/0 limit=-/-
              k1 model.call completed reserve=600/100 cost=100/50
              k2 model.call refused(budget) reserve=500/100
              k4 model.call refused(budget) reserve=500/100
            run root active epoch=1 admitted=2 pending=0 in_flight=1 spent=100/50 reserved=400/400 limit=1000/500
              k0 read started
              k3 model.call admitted reserve=400/400(counted)
        "#]],
    );
}

#[test]
fn settled_spend_reaching_a_parents_limit_fences_its_whole_tree_naming_the_dimension() {
    check(
        "
        0 agent admit root k0 read class=read max_tokens=100
        1 agent admit kid k1 model.call parent=root start=false reserve=0/60
        2 agent admit kid k2 model.call parent=root start=false reserve=0/30 arg=b
        3 agent start kid k1 1.1
        4 agent start kid k2 1.2
        5 agent complete kid k1 1.1 ok cost=5/100
        6 agent complete kid k2 1.2 ok cost=1/7
        7 agent admit kid k3 model.call parent=root reserve=0/1 arg=c
        8 agent admit root k4 read class=read arg=d
        ",
        expect![[r#"
            0 agent admit root k0 read class=read max_tokens=100 => admitted 1.1
            1 agent admit kid k1 model.call parent=root start=false reserve=0/60 => admitted 1.1
            2 agent admit kid k2 model.call parent=root start=false reserve=0/30 arg=b => admitted 1.2
            3 agent start kid k1 1.1                     => go
            4 agent start kid k2 1.2                     => go
            5 agent complete kid k1 1.1 ok cost=5/100    => completed
            6 agent complete kid k2 1.2 ok cost=1/7      => completed late
            7 agent admit kid k3 model.call parent=root reserve=0/1 arg=c => refused budget
            8 agent admit root k4 read class=read arg=d  => refused budget
            --
            run kid cancelled stop=budget from=root epoch=2 admitted=2 pending=0 in_flight=0 parent=root spent=6/107 reserved=0/0 limit=-/- reason="model_tokens: run root spent 100 of its limit 100"
              k1 model.call completed reserve=0/60 cost=5/100
              k2 model.call completed late reserve=0/30 cost=1/7
            run root finalizing stop=budget epoch=2 admitted=1 pending=0 in_flight=1 spent=6/107 reserved=0/0 limit=-/100 reason="model_tokens: run root spent 100 of its limit 100"
              k0 read started
        "#]],
    );
}

#[test]
fn a_stop_frees_reservations_of_calls_not_started_and_keeps_those_in_flight() {
    check(
        "
        0 agent admit r k1 model.call start=false reserve=10/10 max_usd=100
        1 agent admit r k2 model.call reserve=20/20 arg=b
        2 alice cancel r
        3 agent start r k1 1.1
        4 agent admit r k3 model.call reserve=1/1 arg=c
        ",
        expect![[r#"
            0 agent admit r k1 model.call start=false reserve=10/10 max_usd=100 => admitted 1.1
            1 agent admit r k2 model.call reserve=20/20 arg=b => admitted 1.2
            2 alice cancel r                             => run finalizing (1 changed)
            3 agent start r k1 1.1                       => refused cancelled
            4 agent admit r k3 model.call reserve=1/1 arg=c => refused cancelled
            --
            run r finalizing stop=cancelled epoch=2 admitted=2 pending=0 in_flight=1 spent=0/0 reserved=20/20 limit=100/-
              k1 model.call refused(cancelled) reserve=10/10
              k2 model.call started reserve=20/20(counted)
        "#]],
    );
}

#[test]
fn a_call_that_ends_unknown_keeps_its_worst_case_until_its_cost_arrives() {
    check(
        "
        0 agent admit r k1 model.call reserve=10/10 max_usd=100
        1 agent complete r k1 1.1 unknown
        2 agent admit r k2 model.call reserve=90/0 arg=b
        3 agent admit r k3 model.call reserve=91/0 arg=c
        ",
        expect![[r#"
            0 agent admit r k1 model.call reserve=10/10 max_usd=100 => admitted 1.1
            1 agent complete r k1 1.1 unknown            => completed
            2 agent admit r k2 model.call reserve=90/0 arg=b => admitted 1.2
            3 agent admit r k3 model.call reserve=91/0 arg=c => refused budget model_usd of r used=90 limit=100
            --
            run r active epoch=1 admitted=2 pending=0 in_flight=1 spent=0/0 reserved=90/0 limit=100/-
              k1 model.call unknown reserve=10/10
              k2 model.call started reserve=90/0(counted)
              k3 model.call refused(budget) reserve=91/0
        "#]],
    );
}

#[test]
fn a_call_voided_before_it_started_that_ran_anyway_is_charged() {
    check(
        "
        0 agent admit r k1 model.call start=false reserve=10/10 max_usd=100
        1 alice cancel r
        2 agent complete r k1 1.1 ok cost=120/3
        ",
        expect![[r#"
            0 agent admit r k1 model.call start=false reserve=10/10 max_usd=100 => admitted 1.1
            1 alice cancel r                             => run cancelled (1 changed)
            2 agent complete r k1 1.1 ok cost=120/3      => completed late
            --
            run r cancelled stop=cancelled epoch=2 admitted=1 pending=0 in_flight=0 spent=120/3 reserved=0/0 limit=100/-
              k1 model.call refused(cancelled) late reserve=10/10 cost=120/3
        "#]],
    );
}

#[test]
fn a_held_call_reserves_only_when_admitted_and_is_checked_again_then() {
    check(
        "
        0 agent admit r k1 model.call action=approve reserve=60/0 max_usd=100
        1 agent admit r k2 model.call class=read reserve=50/0 arg=b
        2 alice approve r k1
        3 agent wait r k1
        4 agent complete r k2 1.1 ok cost=10/0
        5 agent admit r k3 model.call class=read reserve=60/0 arg=c
        ",
        expect![[r#"
            0 agent admit r k1 model.call action=approve reserve=60/0 max_usd=100 => held approval #1 until 1000
            1 agent admit r k2 model.call class=read reserve=50/0 arg=b => admitted 1.1
            2 alice approve r k1                         => decided approved
            3 agent wait r k1                            => refused budget model_usd of r used=50 limit=100
            4 agent complete r k2 1.1 ok cost=10/0       => completed
            5 agent admit r k3 model.call class=read reserve=60/0 arg=c => admitted 1.2
            --
            run r active epoch=1 admitted=2 pending=0 in_flight=1 spent=10/0 reserved=60/0 limit=100/-
              k1 model.call refused(budget) approvers=alice reserve=60/0
              k2 model.call completed reserve=50/0 cost=10/0
              k3 model.call started reserve=60/0(counted)
        "#]],
    );
}

#[test]
fn an_adopted_run_brings_its_subtrees_spend_to_its_new_parent() {
    check(
        "
        0 agent admit kid k1 model.call parent=mid reserve=5/5
        1 agent complete kid k1 1.1 ok cost=7/7
        2 agent admit mid k2 read class=read parent=top
        ",
        expect![[r#"
            0 agent admit kid k1 model.call parent=mid reserve=5/5 => admitted 1.1
            1 agent complete kid k1 1.1 ok cost=7/7      => completed
            2 agent admit mid k2 read class=read parent=top => admitted 1.1
            --
            run kid active epoch=1 admitted=1 pending=0 in_flight=0 parent=mid spent=7/7 reserved=0/0 limit=-/-
              k1 model.call completed reserve=5/5 cost=7/7
            run mid active epoch=1 admitted=1 pending=0 in_flight=1 parent=top spent=7/7 reserved=0/0 limit=-/-
              k2 read started
            run top active epoch=1 admitted=0 pending=0 in_flight=0 spent=7/7 reserved=0/0 limit=-/-
        "#]],
    );
}

#[test]
fn spend_bounds_are_typed_refusals_that_change_nothing() {
    check(
        "
        0 agent admit r k1 model.call reserve=1000000000001/0
        1 agent admit r k1 model.call reserve=0/1000000000001
        2 agent admit r k1 model.call reserve=1/1
        3 agent complete r k1 1.1 ok cost=1000000000001/0
        4 agent complete r k1 1.1 ok cost=2/2
        ",
        expect![[r#"
            0 agent admit r k1 model.call reserve=1000000000001/0 => error limit: limit reached: spend_usd_micros_max = 1000000000000
            1 agent admit r k1 model.call reserve=0/1000000000001 => error limit: limit reached: spend_tokens_max = 1000000000000
            2 agent admit r k1 model.call reserve=1/1    => admitted 1.1
            3 agent complete r k1 1.1 ok cost=1000000000001/0 => error limit: limit reached: spend_usd_micros_max = 1000000000000
            4 agent complete r k1 1.1 ok cost=2/2        => completed
            --
            run r active epoch=1 admitted=1 pending=0 in_flight=0 spent=2/2 reserved=0/0 limit=-/-
              k1 model.call completed reserve=1/1 cost=2/2
        "#]],
    );
}

#[test]
fn a_runs_own_dollar_limit_fences_it_when_settled_spend_reaches_it() {
    check(
        "
        0 agent admit r k1 model.call reserve=40/1 max_usd=100
        1 agent complete r k1 1.1 ok cost=99/1
        2 agent admit r k2 model.call reserve=1/1 arg=b
        3 agent complete r k2 1.2 unknown cost=1/1
        4 agent admit r k3 read class=read arg=c
        ",
        expect![[r#"
            0 agent admit r k1 model.call reserve=40/1 max_usd=100 => admitted 1.1
            1 agent complete r k1 1.1 ok cost=99/1       => completed
            2 agent admit r k2 model.call reserve=1/1 arg=b => admitted 1.2
            3 agent complete r k2 1.2 unknown cost=1/1   => completed
            4 agent admit r k3 read class=read arg=c     => refused budget
            --
            run r cancelled stop=budget epoch=2 admitted=2 pending=0 in_flight=0 spent=100/2 reserved=0/0 limit=100/- reason="model_usd: run r spent 100 of its limit 100"
              k1 model.call completed reserve=40/1 cost=99/1
              k2 model.call unknown reserve=1/1 cost=1/1
        "#]],
    );
}

/// Regression (found by the differential): a parent forgotten by retention while its child's
/// call was in flight, its id then taken by a new run, had the child's reservation released
/// on the new run (below zero). Retention now keeps a run while its tree holds a reservation,
/// and spend counts only on parents that still list the child.
#[test]
fn regression_retention_keeps_a_run_whose_tree_holds_a_reservation() {
    check(
        "
        0 agent admit p k0 read class=read max_usd=100
        1 agent complete p k0 1.1 ok
        2 agent admit c k1 model.call parent=p reserve=30/3
        3 agent close p
        4 alice compact 10 10
        5 agent complete c k1 1.1 ok cost=20/2
        6 alice compact 10 10
        7 agent admit p k2 model.call reserve=10/1
        8 agent admit q k3 read class=read parent=c
        ",
        expect![[r#"
            0 agent admit p k0 read class=read max_usd=100 => admitted 1.1
            1 agent complete p k0 1.1 ok                 => completed
            2 agent admit c k1 model.call parent=p reserve=30/3 => admitted 1.1
            3 agent close p                              => run completed (2 changed)
            4 alice compact 10 10                        => forgot 0 runs, dropped 0 tombstones
            5 agent complete c k1 1.1 ok cost=20/2       => completed late
            6 alice compact 10 10                        => forgot 2 runs, dropped 0 tombstones
            7 agent admit p k2 model.call reserve=10/1   => admitted 1.1
            8 agent admit q k3 read class=read parent=c  => admitted 1.1
            --
            run c active epoch=1 admitted=0 pending=0 in_flight=0
            run p active epoch=1 admitted=1 pending=0 in_flight=1 spent=0/0 reserved=10/1 limit=-/-
              k2 model.call started reserve=10/1(counted)
            run q active epoch=1 admitted=1 pending=0 in_flight=1 parent=c
              k3 read started
        "#]],
    );
}
