//! The scheduler under random load: weighted fairness within DRR's bound, no credit hoarded
//! across an idle spell, and never more through the bucket than the provider's rate.

use estop_harness::scheduler::{Class, Next, Scheduler, TokenBucket, Weights};
use proptest::prelude::*;

const Q: u64 = 100;
const CMAX: u64 = 400;

fn unlimited() -> TokenBucket {
    TokenBucket::new(u64::MAX / 4, u64::MAX / 4, 0)
}

fn class_of(i: usize) -> Class {
    Class::ALL[i % 3]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    /// Every class backlogged: each class's served tokens divided by its weight stay within
    /// Q + Cmax of every other's, at every pick.
    #[test]
    fn served_tokens_follow_the_weights(costs in proptest::collection::vec(1u64..=CMAX, 300..600)) {
        let w = Weights::default();
        let mut s = Scheduler::new(w, Q, unlimited());
        let mut next_cost = costs.iter().cycle();
        let mut served = [0u64; 3];
        let mut id = 0u64;
        for c in Class::ALL {
            for _ in 0..3 {
                s.push((id, c), c, *next_cost.next().unwrap());
                id += 1;
            }
        }
        let mut cost_of = std::collections::HashMap::new();
        // Re-derive each item's cost from what was pushed.
        let mut s2_costs = costs.iter().cycle();
        for i in 0..9u64 { cost_of.insert(i, *s2_costs.next().unwrap()); }
        for _ in 0..costs.len() {
            let Next::Run((picked, class)) = s.next(0) else { panic!("backlogged") };
            served[class as usize] += cost_of[&picked];
            // Keep the class backlogged.
            let c = *next_cost.next().unwrap();
            cost_of.insert(id, c);
            s.push((id, class), class, c);
            id += 1;
            for a in Class::ALL {
                for b in Class::ALL {
                    let na = served[a as usize] as f64 / w.of(a) as f64;
                    let nb = served[b as usize] as f64 / w.of(b) as f64;
                    prop_assert!((na - nb).abs() <= (Q + CMAX) as f64,
                        "{:?} {} vs {:?} {} (served {:?})", a, na, b, nb, served);
                }
            }
        }
    }

    /// A class idle for any number of rounds returns with no credit: its first visit serves
    /// at most its weight's quantum.
    #[test]
    fn an_idle_class_hoards_nothing(idle_picks in 1usize..400, weight in 1u64..8) {
        let w = Weights { interactive: weight, standard: 2, batch: 1 };
        let mut s = Scheduler::new(w, Q, unlimited());
        for i in 0..idle_picks as u64 + 10 { s.push(i, Class::Batch, 50); }
        for _ in 0..idle_picks { prop_assert!(matches!(s.next(0), Next::Run(_))); }
        for i in 0..1000u64 { s.push(10_000 + i, Class::Interactive, 1); }
        // Count interactive picks until the first batch pick after them began.
        let mut run = 0u64;
        let mut started = false;
        for _ in 0..2000 {
            match s.next(0) {
                Next::Run(id) if id >= 10_000 => { started = true; run += 1; }
                Next::Run(_) if started => break,
                Next::Run(_) => {}
                other => panic!("{other:?}"),
            }
        }
        prop_assert!(run <= weight * Q, "{} interactive turns in one visit (weight {})", run, weight);
        prop_assert!(run > 0);
    }

    /// The bucket: tokens taken by time t never exceed one minute's worth plus the refill.
    #[test]
    fn the_bucket_holds_the_rate(costs in proptest::collection::vec(1u64..5_000, 1..200), step_ms in 1u64..2_000) {
        let (tpm, rpm) = (20_000u64, 60u64);
        let mut s = Scheduler::new(Weights::default(), Q, TokenBucket::new(tpm, rpm, 0));
        let mut now = 0u64;
        let (mut taken, mut requests) = (0u64, 0u64);
        let mut pending: std::collections::VecDeque<u64> = costs.iter().copied().collect();
        let mut id = 0u64;
        if let Some(c) = pending.pop_front() { s.push((id, c), Class::Standard, c); id += 1; }
        for _ in 0..2_000 {
            match s.next(now) {
                Next::Run((_, c)) => {
                    taken += c.min(tpm);
                    requests += 1;
                    if let Some(c) = pending.pop_front() { s.push((id, c), Class::Standard, c); id += 1; }
                }
                Next::Wait { until_ms } => { prop_assert!(until_ms > now); now = until_ms; }
                Next::Idle => break,
            }
            prop_assert!(taken <= tpm + now * tpm / 60_000 + 1, "{} tokens by {} ms", taken, now);
            prop_assert!(requests <= rpm + now * rpm / 60_000 + 1, "{} requests by {} ms", requests, now);
            now += step_ms;
        }
        prop_assert!(s.is_empty(), "every turn ran in the end");
    }
}

/// A trajectory removed from the queue (it left READY) takes its class's deficit with it when
/// it was the last: a later arrival starts from zero.
#[test]
fn removing_the_last_item_drops_the_deficit() {
    let mut s = Scheduler::new(Weights::default(), Q, unlimited());
    s.push(1, Class::Interactive, 300);
    s.push(2, Class::Interactive, 10_000);
    assert_eq!(s.next(0), Next::Run(1));
    assert!(s.deficit(Class::Interactive) > 0);
    s.remove(&2);
    assert_eq!(s.deficit(Class::Interactive), 0);
    assert!(s.is_empty());
    assert_eq!(s.next(0), Next::Idle);
    let _ = class_of(0);
}
