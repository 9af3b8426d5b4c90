//! The reverse saga as data (SPEC G8, §4.8): each script cancels a run and walks its
//! compensations; the transcript shows every reply and the state it leaves. Regenerate after an
//! intended change with `UPDATE_EXPECT=1 cargo test -p estop-kernel --test sagas`.

mod support;

use expect_test::expect;
use support::check;

#[test]
fn cancel_compensates_newest_first_then_the_run_is_cancelled() {
    check(
        r#"
        0 agent admit r1 k1 refund comp=unrefund cargs={"id":result}
        1 agent complete r1 k1 1.1 ok
        2 agent admit r1 k2 email
        3 agent complete r1 k2 1.2 ok
        4 agent admit r1 k3 refund comp=unrefund arg=b
        5 agent complete r1 k3 1.3 ok
        6 alice cancel r1
        7 agent begin r1 k1 1
        8 agent begin r1 k3 1 args={}
        9 agent begin r1 k3 1 args={}
        10 agent end r1 k3 1 ok
        11 agent end r1 k3 1 ok
        12 agent begin r1 k1 1
        13 agent end r1 k1 1 ok
        "#,
        expect![[r#"
            0 agent admit r1 k1 refund comp=unrefund cargs={"id":result} => admitted 1.1
            1 agent complete r1 k1 1.1 ok                => completed
            2 agent admit r1 k2 email                    => admitted 1.2
            3 agent complete r1 k2 1.2 ok                => completed
            4 agent admit r1 k3 refund comp=unrefund arg=b => admitted 1.3
            5 agent complete r1 k3 1.3 ok                => completed
            6 alice cancel r1                            => run finalizing (1 changed)
            7 agent begin r1 k1 1                        => error saga: effect k1 of run r1: the saga compensates newest first: k3 comes before it
            8 agent begin r1 k3 1 args={}                => compensation compensating attempt=1
            9 agent begin r1 k3 1 args={}                => compensation compensating attempt=1
            10 agent end r1 k3 1 ok                      => compensation compensated attempt=1
            11 agent end r1 k3 1 ok                      => compensation compensated attempt=1
            12 agent begin r1 k1 1                       => compensation compensating attempt=1
            13 agent end r1 k1 1 ok                      => compensation compensated attempt=1
            --
            run r1 cancelled stop=cancelled epoch=2 admitted=3 pending=0 in_flight=0
              k1 refund compensated undo=unrefund undo_args={"id":result} args={"arg":""} attempts=1/5
              k2 email completed
              k3 refund compensated undo=unrefund attempts=1/5
        "#]],
    );
}

#[test]
fn a_kill_and_other_stops_compensate_nothing() {
    check(
        "
        0 agent admit r1 k1 refund comp=unrefund
        1 agent complete r1 k1 1.1 ok
        2 alice kill r1
        3 agent begin r1 k1 1
        4 agent admit r2 k1 refund comp=unrefund
        5 agent complete r2 k1 1.1 ok
        6 agent close r2
        7 agent begin r2 k1 1
        ",
        expect![[r#"
            0 agent admit r1 k1 refund comp=unrefund     => admitted 1.1
            1 agent complete r1 k1 1.1 ok                => completed
            2 alice kill r1                              => run cancelled (1 changed)
            3 agent begin r1 k1 1                        => error saga: effect k1 of run r1: it is not awaiting compensation (only a cancelled run's open compensable effects are)
            4 agent admit r2 k1 refund comp=unrefund     => admitted 1.1
            5 agent complete r2 k1 1.1 ok                => completed
            6 agent close r2                             => run completed (1 changed)
            7 agent begin r2 k1 1                        => error saga: effect k1 of run r2: it is not awaiting compensation (only a cancelled run's open compensable effects are)
            --
            run r1 cancelled stop=killed epoch=2 admitted=1 pending=0 in_flight=0
              k1 refund completed undo=unrefund
            run r2 completed stop=closed epoch=2 admitted=1 pending=0 in_flight=0
              k1 refund completed undo=unrefund
        "#]],
    );
}

#[test]
fn failed_attempts_back_off_then_ask_a_human_who_retries() {
    check(
        "
        0 agent admit r1 k1 refund comp=unrefund
        1 agent complete r1 k1 1.1 ok
        2 alice cancel r1
        3 agent begin r1 k1 1
        4 agent end r1 k1 1 error error=timeout
        5 agent begin r1 k1 2
        6 agent begin r1 k1 3
        1004 agent begin r1 k1 2
        1004 agent begin r1 k1 2
        1005 agent end r1 k1 2 error
        1006 agent end r1 k1 2 error
        3005 agent begin r1 k1 3
        3006 agent end r1 k1 3 error
        7006 agent begin r1 k1 4
        7007 agent end r1 k1 4 error
        15007 agent begin r1 k1 5
        15008 agent end r1 k1 5 error error=gone
        15009 agent begin r1 k1 6
        15010 agent retry r1 k1
        15011 alice retry r1 k1
        15012 agent begin r1 k1 6
        15013 agent end r1 k1 6 ok
        ",
        expect![[r#"
            0 agent admit r1 k1 refund comp=unrefund     => admitted 1.1
            1 agent complete r1 k1 1.1 ok                => completed
            2 alice cancel r1                            => run finalizing (1 changed)
            3 agent begin r1 k1 1                        => compensation compensating attempt=1
            4 agent end r1 k1 1 error error=timeout      => compensation compensation_failed attempt=1 retry_at=1004
            5 agent begin r1 k1 2                        => error saga: effect k1 of run r1: the retry is due at 1004 (backoff); try again then
            6 agent begin r1 k1 3                        => error saga: effect k1 of run r1: the next attempt of its compensation is 2, not 3
            1004 agent begin r1 k1 2                     => compensation compensating attempt=2
            1004 agent begin r1 k1 2                     => compensation compensating attempt=2
            1005 agent end r1 k1 2 error                 => compensation compensation_failed attempt=2 retry_at=3005
            1006 agent end r1 k1 2 error                 => compensation compensation_failed attempt=2 retry_at=3005
            3005 agent begin r1 k1 3                     => compensation compensating attempt=3
            3006 agent end r1 k1 3 error                 => compensation compensation_failed attempt=3 retry_at=7006
            7006 agent begin r1 k1 4                     => compensation compensating attempt=4
            7007 agent end r1 k1 4 error                 => compensation compensation_failed attempt=4 retry_at=15007
            15007 agent begin r1 k1 5                    => compensation compensating attempt=5
            15008 agent end r1 k1 5 error error=gone     => compensation needs_human attempt=5
            15009 agent begin r1 k1 6                    => error saga: effect k1 of run r1: its compensation cannot begin while it is needs_human
            15010 agent retry r1 k1                      => error forbidden: operation requires the operator role
            15011 alice retry r1 k1                      => compensation compensation_failed attempt=5 retry_at=15011
            15012 agent begin r1 k1 6                    => compensation compensating attempt=6
            15013 agent end r1 k1 6 ok                   => compensation compensated attempt=6
            --
            run r1 cancelled stop=cancelled epoch=2 admitted=1 pending=0 in_flight=0
              k1 refund compensated undo=unrefund attempts=6/10 by=alice
        "#]],
    );
}

#[test]
fn an_unknown_outcome_is_settled_before_anything_older_is_compensated() {
    check(
        "
        0 agent admit r1 k1 refund comp=unrefund
        1 agent complete r1 k1 1.1 ok
        2 agent admit r1 k2 charge comp=uncharge
        3 agent complete r1 k2 1.2 unknown
        4 agent admit r1 k3 refund comp=unrefund arg=c
        5 agent complete r1 k3 1.3 ok
        6 alice cancel r1
        7 agent begin r1 k3 1
        8 agent end r1 k3 1 ok
        9 agent begin r1 k1 1
        10 agent begin r1 k2 1
        11 alice settle r1 k2 unknown
        12 alice settle r1 k1 ok
        13 alice settle r1 k2 ok
        14 agent begin r1 k2 1
        15 agent end r1 k2 1 unknown
        16 alice skip r1 k2
        17 alice skip r1 k2 reason=checked-by-hand
        18 agent begin r1 k1 1
        19 agent end r1 k1 1 ok
        ",
        expect![[r#"
            0 agent admit r1 k1 refund comp=unrefund     => admitted 1.1
            1 agent complete r1 k1 1.1 ok                => completed
            2 agent admit r1 k2 charge comp=uncharge     => admitted 1.2
            3 agent complete r1 k2 1.2 unknown           => completed
            4 agent admit r1 k3 refund comp=unrefund arg=c => admitted 1.3
            5 agent complete r1 k3 1.3 ok                => completed
            6 alice cancel r1                            => run finalizing (1 changed)
            7 agent begin r1 k3 1                        => compensation compensating attempt=1
            8 agent end r1 k3 1 ok                       => compensation compensated attempt=1
            9 agent begin r1 k1 1                        => error saga: effect k1 of run r1: the saga compensates newest first: k2 comes before it
            10 agent begin r1 k2 1                       => error saga: effect k2 of run r1: its compensation cannot begin while it is unknown
            11 alice settle r1 k2 unknown                => error saga: effect k2 of run r1: settling says whether it happened: ok or error
            12 alice settle r1 k1 ok                     => error saga: effect k1 of run r1: only an unknown outcome is settled; it is completed
            13 alice settle r1 k2 ok                     => compensation completed attempt=0
            14 agent begin r1 k2 1                       => compensation compensating attempt=1
            15 agent end r1 k2 1 unknown                 => compensation needs_human attempt=1
            16 alice skip r1 k2                          => error saga: effect k2 of run r1: a skip needs a reason
            17 alice skip r1 k2 reason=checked-by-hand   => compensation compensation_skipped attempt=1
            18 agent begin r1 k1 1                       => compensation compensating attempt=1
            19 agent end r1 k1 1 ok                      => compensation compensated attempt=1
            --
            run r1 cancelled stop=cancelled epoch=2 admitted=3 pending=0 in_flight=0
              k1 refund compensated undo=unrefund attempts=1/5
              k2 charge compensation_skipped undo=uncharge attempts=1/5 note="checked-by-hand" by=alice
              k3 refund compensated undo=unrefund attempts=1/5
        "#]],
    );
}

#[test]
fn an_unknown_outcome_settled_as_not_happened_needs_no_compensation() {
    check(
        "
        0 agent admit r1 k1 charge comp=uncharge
        1 agent complete r1 k1 1.1 unknown
        2 alice cancel r1
        3 alice settle r1 k1 error
        ",
        expect![[r#"
            0 agent admit r1 k1 charge comp=uncharge     => admitted 1.1
            1 agent complete r1 k1 1.1 unknown           => completed
            2 alice cancel r1                            => run finalizing (1 changed)
            3 alice settle r1 k1 error                   => compensation failed attempt=0
            --
            run r1 cancelled stop=cancelled epoch=2 admitted=1 pending=0 in_flight=0
              k1 charge failed undo=uncharge
        "#]],
    );
}

#[test]
fn an_effect_in_flight_at_the_cancel_joins_the_saga_when_it_lands() {
    check(
        "
        0 agent admit r1 k1 refund comp=unrefund
        1 agent complete r1 k1 1.1 ok
        2 agent admit r1 k2 refund comp=unrefund arg=b
        3 alice cancel r1
        4 agent begin r1 k1 1
        5 agent complete r1 k2 1.2 ok
        6 agent begin r1 k2 1
        7 agent end r1 k2 1 ok
        8 alice skip r1 k1 reason=customer-keeps-it
        ",
        expect![[r#"
            0 agent admit r1 k1 refund comp=unrefund     => admitted 1.1
            1 agent complete r1 k1 1.1 ok                => completed
            2 agent admit r1 k2 refund comp=unrefund arg=b => admitted 1.2
            3 alice cancel r1                            => run finalizing (1 changed)
            4 agent begin r1 k1 1                        => error saga: effect k1 of run r1: the saga compensates newest first: k2 comes before it
            5 agent complete r1 k2 1.2 ok                => completed late
            6 agent begin r1 k2 1                        => compensation compensating attempt=1
            7 agent end r1 k2 1 ok                       => compensation compensated attempt=1
            8 alice skip r1 k1 reason=customer-keeps-it  => compensation compensation_skipped attempt=0
            --
            run r1 cancelled stop=cancelled epoch=2 admitted=2 pending=0 in_flight=0
              k1 refund compensation_skipped undo=unrefund attempts=0/5 note="customer-keeps-it" by=alice
              k2 refund compensated late undo=unrefund attempts=1/5
        "#]],
    );
}

#[test]
fn saga_commands_are_refused_where_they_do_not_fit() {
    check(
        "
        0 agent admit r1 k1 refund comp=unrefund
        1 agent complete r1 k1 1.1 ok
        2 agent admit r1 k2 email
        3 agent complete r1 k2 1.2 ok
        4 agent begin r1 k1 1
        5 agent end r1 k1 1 ok
        6 alice cancel r1
        7 alice retry r1 k2
        8 alice settle r1 k1 ok
        9 agent skip r1 k1 reason=x
        10 agent end r1 k1 1 ok
        11 agent begin r1 k9 1
        12 agent2 begin r1 k1 1
        13 bob begin r1 k1 1
        14 alice retry r1 k1
        15 alice skip r1 k1 reason=x
        ",
        expect![[r#"
            0 agent admit r1 k1 refund comp=unrefund     => admitted 1.1
            1 agent complete r1 k1 1.1 ok                => completed
            2 agent admit r1 k2 email                    => admitted 1.2
            3 agent complete r1 k2 1.2 ok                => completed
            4 agent begin r1 k1 1                        => error saga: effect k1 of run r1: it is not awaiting compensation (only a cancelled run's open compensable effects are)
            5 agent end r1 k1 1 ok                       => error saga: effect k1 of run r1: no compensation of it began
            6 alice cancel r1                            => run finalizing (1 changed)
            7 alice retry r1 k2                          => error saga: effect k2 of run r1: retry: it declares no compensating tool
            8 alice settle r1 k1 ok                      => error saga: effect k1 of run r1: only an unknown outcome is settled; it is completed
            9 agent skip r1 k1 reason=x                  => error forbidden: operation requires the operator role
            10 agent end r1 k1 1 ok                      => error saga: effect k1 of run r1: no compensation of it began
            11 agent begin r1 k9 1                       => error not_found: effect k9 of run r1 not found
            12 agent2 begin r1 k1 1                      => error not_found: run r1 not found
            13 bob begin r1 k1 1                         => compensation compensating attempt=1
            14 alice retry r1 k1                         => error saga: effect k1 of run r1: retry: it is compensating
            15 alice skip r1 k1 reason=x                 => error saga: effect k1 of run r1: skip: it is compensating
            --
            run r1 finalizing stop=cancelled epoch=2 admitted=2 pending=0 in_flight=0
              k1 refund compensating undo=unrefund attempts=1/5
              k2 email completed
              saga next: k1 Running { attempt: 1 }
        "#]],
    );
}
