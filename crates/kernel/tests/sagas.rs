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
            3 agent begin r1 k1 1                        => error saga: effect k1 of run r1: it is not awaiting compensation (only a cancelled run's open compensable effects are, and those an operator asked to compensate)
            4 agent admit r2 k1 refund comp=unrefund     => admitted 1.1
            5 agent complete r2 k1 1.1 ok                => completed
            6 agent close r2                             => run completed (1 changed)
            7 agent begin r2 k1 1                        => error saga: effect k1 of run r2: it is not awaiting compensation (only a cancelled run's open compensable effects are, and those an operator asked to compensate)
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
            11 alice settle r1 k2 unknown                => error saga: effect k2 of run r1: it is unknown already: settling says whether it happened: ok or error
            12 alice settle r1 k1 ok                     => error saga: effect k1 of run r1: only an unknown outcome, or a call a stopped run left in flight, is settled; it is completed
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
            4 agent begin r1 k1 1                        => error saga: effect k1 of run r1: it is not awaiting compensation (only a cancelled run's open compensable effects are, and those an operator asked to compensate)
            5 agent end r1 k1 1 ok                       => error saga: effect k1 of run r1: no compensation of it began
            6 alice cancel r1                            => run finalizing (1 changed)
            7 alice retry r1 k2                          => error saga: effect k2 of run r1: retry: it declares no compensating tool
            8 alice settle r1 k1 ok                      => error saga: effect k1 of run r1: only an unknown outcome, or a call a stopped run left in flight, is settled; it is completed
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

#[test]
fn an_unknown_outcome_is_settled_by_its_lookup_before_a_human() {
    // k2 found by its lookup: completed with the result it found, then compensated; k1's
    // lookup finds nothing: it did not happen, nothing to undo.
    check(
        r#"
        0 agent admit r1 k1 charge comp=uncharge lookup=find_charge
        1 agent complete r1 k1 1.1 unknown
        2 agent admit r1 k2 charge comp=uncharge lookup=find_charge arg=b
        3 agent complete r1 k2 1.2 unknown
        4 alice cancel r1
        5 agent begin r1 k2 1
        6 agent lookup r1 k1 1
        7 agent lookup r1 k2 2
        8 agent lookup r1 k2 1
        9 agent lookup r1 k2 1
        10 alice settle r1 k2 ok
        11 agent found r1 k2 1 error result={"id":"ch_1"}
        12 agent found r1 k2 1 ok result={"id":"ch_1"}
        13 agent found r1 k2 1 ok result={"id":"ch_1"}
        14 agent begin r1 k2 1 args={"id":"ch_1"}
        15 agent end r1 k2 1 ok
        16 agent lookup r1 k1 1
        17 agent found r1 k1 1 error error=no-such-charge
        "#,
        expect![[r#"
            0 agent admit r1 k1 charge comp=uncharge lookup=find_charge => admitted 1.1
            1 agent complete r1 k1 1.1 unknown           => completed
            2 agent admit r1 k2 charge comp=uncharge lookup=find_charge arg=b => admitted 1.2
            3 agent complete r1 k2 1.2 unknown           => completed
            4 alice cancel r1                            => run finalizing (1 changed)
            5 agent begin r1 k2 1                        => error saga: effect k2 of run r1: its compensation cannot begin while it is unknown
            6 agent lookup r1 k1 1                       => error saga: effect k1 of run r1: the saga settles newest first: k2 comes before it
            7 agent lookup r1 k2 2                       => error saga: effect k2 of run r1: the next lookup of its outcome is 1, not 2
            8 agent lookup r1 k2 1                       => compensation unknown attempt=1
            9 agent lookup r1 k2 1                       => compensation unknown attempt=1
            10 alice settle r1 k2 ok                     => error saga: effect k2 of run r1: its lookup is under way; settle it when the lookup could not tell
            11 agent found r1 k2 1 error result={"id":"ch_1"} => error saga: effect k2 of run r1: a lookup's result says the call happened: report it with outcome ok
            12 agent found r1 k2 1 ok result={"id":"ch_1"} => compensation completed attempt=1
            13 agent found r1 k2 1 ok result={"id":"ch_1"} => compensation completed attempt=1
            14 agent begin r1 k2 1 args={"id":"ch_1"}    => compensation compensating attempt=1
            15 agent end r1 k2 1 ok                      => compensation compensated attempt=1
            16 agent lookup r1 k1 1                      => compensation unknown attempt=1
            17 agent found r1 k1 1 error error=no-such-charge => compensation failed attempt=1
            --
            run r1 cancelled stop=cancelled epoch=2 admitted=2 pending=0 in_flight=0
              k1 charge failed undo=uncharge lookup=find_charge attempts=0/5 lookups=1/1 note="no-such-charge"
              k2 charge compensated undo=uncharge lookup=find_charge result={"id":"ch_1"} attempts=1/5 lookups=1/1
        "#]],
    );
}

#[test]
fn a_lookup_that_cannot_tell_asks_a_human_who_may_ask_it_again() {
    check(
        "
        0 agent admit r1 k1 charge comp=uncharge lookup=find_charge
        1 agent complete r1 k1 1.1 unknown
        2 alice cancel r1
        3 alice retry r1 k1
        4 agent lookup r1 k1 1
        5 alice retry r1 k1
        6 agent found r1 k1 1 unknown error=lookup-unavailable
        7 agent found r1 k1 1 unknown
        8 agent lookup r1 k1 2
        9 alice retry r1 k1
        10 agent lookup r1 k1 2
        11 agent found r1 k1 2 unknown error=still-down
        12 alice settle r1 k1 error
        ",
        expect![[r#"
            0 agent admit r1 k1 charge comp=uncharge lookup=find_charge => admitted 1.1
            1 agent complete r1 k1 1.1 unknown           => completed
            2 alice cancel r1                            => run finalizing (1 changed)
            3 alice retry r1 k1                          => error saga: effect k1 of run r1: retry: its lookup is due already
            4 agent lookup r1 k1 1                       => compensation unknown attempt=1
            5 alice retry r1 k1                          => error saga: effect k1 of run r1: retry: its lookup 1 is under way
            6 agent found r1 k1 1 unknown error=lookup-unavailable => compensation unknown attempt=1
            7 agent found r1 k1 1 unknown                => compensation unknown attempt=1
            8 agent lookup r1 k1 2                       => error saga: effect k1 of run r1: it awaits no lookup (it is unknown; only the saga's unknown outcome whose tool declares a lookup does)
            9 alice retry r1 k1                          => compensation unknown attempt=1
            10 agent lookup r1 k1 2                      => compensation unknown attempt=2
            11 agent found r1 k1 2 unknown error=still-down => compensation unknown attempt=2
            12 alice settle r1 k1 error                  => compensation failed attempt=0
            --
            run r1 cancelled stop=cancelled epoch=2 admitted=1 pending=0 in_flight=0
              k1 charge failed undo=uncharge lookup=find_charge attempts=0/5 lookups=2/2 note="still-down" by=alice
        "#]],
    );
}

#[test]
fn an_operator_compensates_one_effect_of_a_run_stopped_without_a_saga() {
    // r1 was killed: nothing is compensated until an operator asks, and then only that effect
    // (k1 stays done); the run stays cancelled throughout and is not forgotten while the
    // effect's saga is open. r2 was closed; its unknown outcome is settled first.
    check(
        "
        0 agent admit r1 k1 refund comp=unrefund
        1 agent complete r1 k1 1.1 ok
        2 agent admit r1 k2 refund comp=unrefund arg=b
        3 agent complete r1 k2 1.2 ok
        4 agent admit r1 k3 email arg=c
        5 agent complete r1 k3 1.3 ok
        6 alice compensate r1 k2
        7 alice kill r1
        8 agent begin r1 k2 1
        9 agent compensate r1 k2
        10 alice compensate r1 k3
        11 alice compensate r1 k2
        12 alice compensate r1 k2
        13 alice compact 100 100
        14 agent begin r1 k1 1
        15 agent begin r1 k2 1
        16 agent end r1 k2 1 ok
        17 alice compensate r1 k2
        18 agent admit r2 k1 charge comp=uncharge
        19 agent complete r2 k1 1.1 unknown
        20 agent close r2
        21 alice compensate r2 k1
        22 agent begin r2 k1 1
        23 alice settle r2 k1 ok result={\"id\":\"ch_9\"}
        24 agent begin r2 k1 1
        25 agent end r2 k1 1 error
        26 agent admit r3 k1 refund comp=unrefund
        27 agent complete r3 k1 1.1 ok
        28 alice cancel r3
        29 alice compensate r3 k1
        ",
        expect![[r#"
            0 agent admit r1 k1 refund comp=unrefund     => admitted 1.1
            1 agent complete r1 k1 1.1 ok                => completed
            2 agent admit r1 k2 refund comp=unrefund arg=b => admitted 1.2
            3 agent complete r1 k2 1.2 ok                => completed
            4 agent admit r1 k3 email arg=c              => admitted 1.3
            5 agent complete r1 k3 1.3 ok                => completed
            6 alice compensate r1 k2                     => error saga: effect k2 of run r1: compensate: its run is not stopped (cancel it, or kill or close it first)
            7 alice kill r1                              => run cancelled (1 changed)
            8 agent begin r1 k2 1                        => error saga: effect k2 of run r1: it is not awaiting compensation (only a cancelled run's open compensable effects are, and those an operator asked to compensate)
            9 agent compensate r1 k2                     => error forbidden: operation requires the operator role
            10 alice compensate r1 k3                    => error saga: effect k3 of run r1: compensate: it declares no compensating tool
            11 alice compensate r1 k2                    => compensation completed attempt=0
            12 alice compensate r1 k2                    => compensation completed attempt=0
            13 alice compact 100 100                     => forgot 0 runs, dropped 0 tombstones
            14 agent begin r1 k1 1                       => error saga: effect k1 of run r1: the saga compensates newest first: k2 comes before it
            15 agent begin r1 k2 1                       => compensation compensating attempt=1
            16 agent end r1 k2 1 ok                      => compensation compensated attempt=1
            17 alice compensate r1 k2                    => error saga: effect k2 of run r1: compensate: it is compensated
            18 agent admit r2 k1 charge comp=uncharge    => admitted 1.1
            19 agent complete r2 k1 1.1 unknown          => completed
            20 agent close r2                            => run completed (1 changed)
            21 alice compensate r2 k1                    => compensation unknown attempt=0
            22 agent begin r2 k1 1                       => error saga: effect k1 of run r2: its compensation cannot begin while it is unknown
            23 alice settle r2 k1 ok result={"id":"ch_9"} => compensation completed attempt=0
            24 agent begin r2 k1 1                       => compensation compensating attempt=1
            25 agent end r2 k1 1 error                   => compensation compensation_failed attempt=1 retry_at=1025
            26 agent admit r3 k1 refund comp=unrefund    => admitted 1.1
            27 agent complete r3 k1 1.1 ok               => completed
            28 alice cancel r3                           => run finalizing (1 changed)
            29 alice compensate r3 k1                    => error saga: effect k1 of run r3: compensate: its run was cancelled, so its saga compensates it (retry or skip it there)
            --
            run r1 cancelled stop=killed epoch=2 admitted=3 pending=0 in_flight=0
              k1 refund completed undo=unrefund
              k2 refund compensated undo=unrefund attempts=1/5 chosen by=alice
              k3 email completed
            run r2 completed stop=closed epoch=2 admitted=1 pending=0 in_flight=0
              k1 charge compensation_failed undo=uncharge result={"id":"ch_9"} attempts=1/5 chosen by=alice
              saga next: k1 Begin { attempt: 2, at: 1025 }
            run r3 finalizing stop=cancelled epoch=2 admitted=1 pending=0 in_flight=0
              k1 refund completed undo=unrefund
              saga next: k1 Begin { attempt: 1, at: 0 }
        "#]],
    );
}

#[test]
fn a_compensation_that_cannot_be_issued_asks_a_human_at_once() {
    check(
        "
        0 agent admit r1 k1 refund comp=unrefund
        1 agent complete r1 k1 1.1 ok
        2 alice cancel r1
        3 alice blocked r1 k1 2 reason=x
        4 alice blocked r1 k1 1 reason=policy-denies-unrefund
        5 agent begin r1 k1 1
        6 alice retry r1 k1
        7 agent begin r1 k1 1
        8 agent end r1 k1 1 ok
        ",
        expect![[r#"
            0 agent admit r1 k1 refund comp=unrefund     => admitted 1.1
            1 agent complete r1 k1 1.1 ok                => completed
            2 alice cancel r1                            => run finalizing (1 changed)
            3 alice blocked r1 k1 2 reason=x             => error saga: effect k1 of run r1: the next attempt of its compensation is 1, not 2
            4 alice blocked r1 k1 1 reason=policy-denies-unrefund => compensation needs_human attempt=0
            5 agent begin r1 k1 1                        => error saga: effect k1 of run r1: its compensation cannot begin while it is needs_human
            6 alice retry r1 k1                          => compensation compensation_failed attempt=0 retry_at=6
            7 agent begin r1 k1 1                        => compensation compensating attempt=1
            8 agent end r1 k1 1 ok                       => compensation compensated attempt=1
            --
            run r1 cancelled stop=cancelled epoch=2 admitted=1 pending=0 in_flight=0
              k1 refund compensated undo=unrefund attempts=1/5 by=alice
        "#]],
    );
}

#[test]
fn a_call_a_stopped_runs_agent_left_in_flight_is_settled_by_an_operator() {
    // k2 started and its agent died: the saga waits for its outcome, the run stays finalizing.
    // Settled unknown, it is looked up (here: no lookup, so an operator says); settled ok, it is
    // undone. A late report of the agent still lands where it agrees, and is refused where not.
    check(
        "
        0 agent admit r1 k1 refund comp=unrefund
        1 agent complete r1 k1 1.1 ok
        2 agent admit r1 k2 charge comp=uncharge lookup=find_charge arg=b
        3 alice settle r1 k2 unknown
        4 alice cancel r1
        5 alice settle r1 k1 unknown
        6 alice settle r1 k2 error result={}
        7 alice settle r1 k2 unknown
        8 alice settle r1 k2 unknown
        9 agent lookup r1 k2 1
        10 agent found r1 k2 1 unknown error=provider-down
        11 alice settle r1 k2 ok
        12 agent complete r1 k2 1.2 ok
        13 agent complete r1 k2 1.2 error
        14 agent admit r2 k1 refund comp=unrefund
        15 alice kill r2
        16 alice settle r2 k1 error
        ",
        expect![[r#"
            0 agent admit r1 k1 refund comp=unrefund     => admitted 1.1
            1 agent complete r1 k1 1.1 ok                => completed
            2 agent admit r1 k2 charge comp=uncharge lookup=find_charge arg=b => admitted 1.2
            3 alice settle r1 k2 unknown                 => error saga: effect k2 of run r1: it is in flight and its run is not stopped: its agent reports it (stop the run to settle it by hand)
            4 alice cancel r1                            => run finalizing (1 changed)
            5 alice settle r1 k1 unknown                 => error saga: effect k1 of run r1: only an unknown outcome, or a call a stopped run left in flight, is settled; it is completed
            6 alice settle r1 k2 error result={}         => error saga: effect k2 of run r1: a result settles it as ok: a call that did not happen has none
            7 alice settle r1 k2 unknown                 => compensation unknown attempt=0
            8 alice settle r1 k2 unknown                 => error saga: effect k2 of run r1: it is unknown already: settling says whether it happened: ok or error
            9 agent lookup r1 k2 1                       => compensation unknown attempt=1
            10 agent found r1 k2 1 unknown error=provider-down => compensation unknown attempt=1
            11 alice settle r1 k2 ok                     => compensation completed attempt=0
            12 agent complete r1 k2 1.2 ok               => completed
            13 agent complete r1 k2 1.2 error            => disputed settled=completed
            14 agent admit r2 k1 refund comp=unrefund    => admitted 1.1
            15 alice kill r2                             => run finalizing (1 changed)
            16 alice settle r2 k1 error                  => compensation failed attempt=0
            --
            run r1 finalizing stop=cancelled epoch=2 admitted=2 pending=0 in_flight=0
              k1 refund completed undo=unrefund
              k2 charge completed disputes=1 undo=uncharge lookup=find_charge attempts=0/5 lookups=1/1 note="provider-down"
              saga next: k2 Begin { attempt: 1, at: 0 }
            run r2 cancelled stop=killed epoch=2 admitted=1 pending=0 in_flight=0
              k1 refund failed undo=unrefund
        "#]],
    );
}

#[test]
fn a_call_left_in_flight_past_the_deadline_after_the_stop_becomes_unknown() {
    // The agent of r1 died with k2 (a charge with a lookup) and k3 (an email) in flight. The
    // gate's timer takes each for unreported 1000 ms after the cancel: k2 is then looked up,
    // k3 (no compensation) stops keeping the run finalizing. Not before the deadline, not for a
    // running run, not by an agent, not for a call that reported; the step carries its
    // deadline, so replay does not read today's setting.
    check(
        "
        0 agent admit r1 k1 refund comp=unrefund
        1 agent complete r1 k1 1.1 ok
        2 agent admit r1 k2 charge comp=uncharge lookup=find_charge
        3 agent admit r1 k3 email
        4 alice unreported r1 k2 1000
        5 alice cancel r1
        1004 alice unreported r1 k2 1000
        1005 agent unreported r1 k2 1000
        1005 alice unreported r1 k1 1000
        1005 alice unreported r1 k2 1000
        1005 alice unreported r1 k2 1000
        1006 alice unreported r1 k3 1000
        1007 agent complete r1 k3 1.3 ok
        1008 agent admit r2 k1 email
        1009 alice kill r2
        1009 alice unreported r2 k1 0
        ",
        expect![[r#"
            0 agent admit r1 k1 refund comp=unrefund     => admitted 1.1
            1 agent complete r1 k1 1.1 ok                => completed
            2 agent admit r1 k2 charge comp=uncharge lookup=find_charge => admitted 1.2
            3 agent admit r1 k3 email                    => admitted 1.3
            4 alice unreported r1 k2 1000                => error saga: effect k2 of run r1: it is in flight and its run is not stopped: its agent reports it
            5 alice cancel r1                            => run finalizing (1 changed)
            1004 alice unreported r1 k2 1000             => error saga: effect k2 of run r1: its agent may report it until 1005 (1000 ms after the stop)
            1005 agent unreported r1 k2 1000             => error forbidden: operation requires the operator role
            1005 alice unreported r1 k1 1000             => error saga: effect k1 of run r1: it is completed, not left in flight
            1005 alice unreported r1 k2 1000             => compensation unknown attempt=0
            1005 alice unreported r1 k2 1000             => error saga: effect k2 of run r1: it is unknown, not left in flight
            1006 alice unreported r1 k3 1000             => compensation unknown attempt=0
            1007 agent complete r1 k3 1.3 ok             => completed late
            1008 agent admit r2 k1 email                 => admitted 1.1
            1009 alice kill r2                           => run finalizing (1 changed)
            1009 alice unreported r2 k1 0                => compensation unknown attempt=0
            --
            run r1 finalizing stop=cancelled epoch=2 admitted=3 pending=0 in_flight=0
              k1 refund completed undo=unrefund
              k2 charge unknown undo=uncharge lookup=find_charge
              k3 email completed late
              saga next: k2 Lookup { attempt: 1 }
            run r2 cancelled stop=killed epoch=2 admitted=1 pending=0 in_flight=0
              k1 email unknown
        "#]],
    );
}

#[test]
fn a_compensation_a_policy_holds_needs_its_quorum_not_one_operators_retry() {
    // The policy's `approve` rule on `unrefund` (quorum 2, group finance) holds the due attempt
    // as approval #1 of the run: nothing begins until the quorum is met, one operator cannot
    // meet it alone (not by voting twice, not by retrying), an agent cannot vote, and the
    // votes are counted as an admission's (distinct principals, each group met).
    check(
        r#"
        0 agent admit r1 k1 refund comp=unrefund
        1 agent complete r1 k1 1.1 ok
        2 alice cancel r1
        3 agent hold r1 k1 1 quorum=2 groups=finance expiry=5000
        4 alice hold r1 k1 1 quorum=2 groups=finance expiry=5000 args={"id":1}
        5 agent begin r1 k1 1
        6 agent approve r1 k1
        7 alice approve r1 k1
        8 alice approve r1 k1
        9 alice retry r1 k1
        10 agent begin r1 k1 1
        11 bob approve r1 k1
        12 agent begin r1 k1 1
        13 carol approve r1 k1
        14 dave approve r1 k1
        15 agent begin r1 k1 1 args={"id":1}
        16 agent end r1 k1 1 error
        1016 agent begin r1 k1 2 args={"id":1}
        1017 agent end r1 k1 2 ok
        "#,
        expect![[r#"
            0 agent admit r1 k1 refund comp=unrefund     => admitted 1.1
            1 agent complete r1 k1 1.1 ok                => completed
            2 alice cancel r1                            => run finalizing (1 changed)
            3 agent hold r1 k1 1 quorum=2 groups=finance expiry=5000 => error forbidden: operation requires the operator role
            4 alice hold r1 k1 1 quorum=2 groups=finance expiry=5000 args={"id":1} => compensation completed attempt=0
            5 agent begin r1 k1 1                        => error saga: effect k1 of run r1: its compensating call awaits approval r1#1
            6 agent approve r1 k1                        => error forbidden: operation requires the operator role
            7 alice approve r1 k1                        => decided pending 1/2 missing finance
            8 alice approve r1 k1                        => error duplicate_approver: alice has already approved effect k1 of run r1; a quorum needs distinct approvers
            9 alice retry r1 k1                          => error undo_awaits_approval: the compensation of effect k1 of run r1 awaits approval r1#1: decide it with approve or reject (a quorum of distinct approvers), not retry
            10 agent begin r1 k1 1                       => error saga: effect k1 of run r1: its compensating call awaits approval r1#1
            11 bob approve r1 k1                         => decided pending 2/2 missing finance
            12 agent begin r1 k1 1                       => error saga: effect k1 of run r1: its compensating call awaits approval r1#1
            13 carol approve r1 k1                       => decided approved
            14 dave approve r1 k1                        => error not_awaiting_approval: effect k1 of run r1 is not awaiting approval (it is completed)
            15 agent begin r1 k1 1 args={"id":1}         => compensation compensating attempt=1
            16 agent end r1 k1 1 error                   => compensation compensation_failed attempt=1 retry_at=1016
            1016 agent begin r1 k1 2 args={"id":1}       => compensation compensating attempt=2
            1017 agent end r1 k1 2 ok                    => compensation compensated attempt=2
            --
            run r1 cancelled stop=cancelled epoch=2 admitted=1 pending=0 in_flight=0
              k1 refund compensated undo=unrefund attempts=2/5 undo_approval=#1 3/2 by alice,bob,carol
        "#]],
    );
}

#[test]
fn a_rejected_or_expired_compensation_approval_asks_a_human_and_a_retry_asks_again() {
    check(
        "
        0 agent admit r1 k1 refund comp=unrefund
        1 agent complete r1 k1 1.1 ok
        2 alice cancel r1
        3 alice hold r1 k1 1 quorum=2 expiry=100
        4 bob reject r1 k1 reason=not-this-one
        5 agent begin r1 k1 1
        6 alice retry r1 k1
        7 alice hold r1 k1 1 quorum=2 expiry=100
        8 alice approve r1 k1
        9 alice retry r1 k1
        106 alice expired r1 k1 2
        107 bob approve r1 k1
        107 alice expired r1 k1 1
        107 agent expired r1 k1 2
        107 alice expired r1 k1 2
        108 bob approve r1 k1
        109 alice skip r1 k1 reason=refunded-by-hand
        ",
        expect![[r#"
            0 agent admit r1 k1 refund comp=unrefund     => admitted 1.1
            1 agent complete r1 k1 1.1 ok                => completed
            2 alice cancel r1                            => run finalizing (1 changed)
            3 alice hold r1 k1 1 quorum=2 expiry=100     => compensation completed attempt=0
            4 bob reject r1 k1 reason=not-this-one       => decided rejected
            5 agent begin r1 k1 1                        => error saga: effect k1 of run r1: its compensation cannot begin while it is needs_human
            6 alice retry r1 k1                          => compensation compensation_failed attempt=0 retry_at=6
            7 alice hold r1 k1 1 quorum=2 expiry=100     => compensation compensation_failed attempt=0 retry_at=6
            8 alice approve r1 k1                        => decided pending 1/2
            9 alice retry r1 k1                          => error undo_awaits_approval: the compensation of effect k1 of run r1 awaits approval r1#2: decide it with approve or reject (a quorum of distinct approvers), not retry
            106 alice expired r1 k1 2                    => error saga: effect k1 of run r1: approval r1#2 is open until 107
            107 bob approve r1 k1                        => error not_awaiting_approval: effect k1 of run r1 is not awaiting approval (it is expired)
            107 alice expired r1 k1 1                    => error saga: effect k1 of run r1: its compensation does not await approval r1#1
            107 agent expired r1 k1 2                    => error forbidden: operation requires the operator role
            107 alice expired r1 k1 2                    => compensation needs_human attempt=0
            108 bob approve r1 k1                        => error not_awaiting_approval: effect k1 of run r1 is not awaiting approval (it is needs_human)
            109 alice skip r1 k1 reason=refunded-by-hand => compensation compensation_skipped attempt=0
            --
            run r1 cancelled stop=cancelled epoch=2 admitted=1 pending=0 in_flight=0
              k1 refund compensation_skipped undo=unrefund attempts=0/5 note="refunded-by-hand" by=alice undo_approval=#2 1/2 by alice
        "#]],
    );
}

#[test]
fn a_met_compensation_approval_stands_and_is_not_asked_again() {
    // Once the quorum is met, the approval stands for this attempt and the later ones: a second
    // hold (a shell that asked again, after a failed attempt or twice for the same one) would
    // replace a met approval with a fresh one and ask the approvers for what they already gave.
    check(
        r#"
        0 agent admit r1 k1 refund comp=unrefund
        1 agent complete r1 k1 1.1 ok
        2 alice cancel r1
        3 alice hold r1 k1 1 quorum=1 expiry=5000
        4 bob approve r1 k1
        5 alice hold r1 k1 1 quorum=1 expiry=5000
        6 agent begin r1 k1 1
        7 agent end r1 k1 1 error
        1007 alice hold r1 k1 2 quorum=1 expiry=5000
        1008 agent begin r1 k1 2
        1009 agent end r1 k1 2 ok
        "#,
        expect![[r#"
            0 agent admit r1 k1 refund comp=unrefund     => admitted 1.1
            1 agent complete r1 k1 1.1 ok                => completed
            2 alice cancel r1                            => run finalizing (1 changed)
            3 alice hold r1 k1 1 quorum=1 expiry=5000    => compensation completed attempt=0
            4 bob approve r1 k1                          => decided approved
            5 alice hold r1 k1 1 quorum=1 expiry=5000    => error saga: effect k1 of run r1: its compensating call's approval r1#1 is met; it stands for every attempt
            6 agent begin r1 k1 1                        => compensation compensating attempt=1
            7 agent end r1 k1 1 error                    => compensation compensation_failed attempt=1 retry_at=1007
            1007 alice hold r1 k1 2 quorum=1 expiry=5000 => error saga: effect k1 of run r1: its compensating call's approval r1#1 is met; it stands for every attempt
            1008 agent begin r1 k1 2                     => compensation compensating attempt=2
            1009 agent end r1 k1 2 ok                    => compensation compensated attempt=2
            --
            run r1 cancelled stop=cancelled epoch=2 admitted=1 pending=0 in_flight=0
              k1 refund compensated undo=unrefund attempts=2/5 undo_approval=#1 1/1 by bob
        "#]],
    );
}
