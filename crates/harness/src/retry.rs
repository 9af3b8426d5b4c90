//! How a failed model call is retried: exponential backoff with full jitter, at least the
//! provider's `Retry-After` (capped), and a bounded number of retries in a row. Pure: the time
//! and the random draw are arguments, so the record's turn logic stays deterministic and the
//! delay of every retry is journalled with the record (docs/HARNESS.md, "Retries").

use serde::{Deserialize, Serialize};

/// The retry policy of a model (`[[model]]`'s `retry_base_ms`, `retry_cap_ms`, `retries_max`,
/// `retry_after_max_ms`), kept in the record's call limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retry {
    /// The first retry's ceiling; each further one doubles it.
    pub base_ms: u64,
    /// The ceiling never grows past this.
    pub cap_ms: u64,
    /// Failed calls in a row retried; the next failure ends the trajectory FAILED.
    pub retries_max: u32,
    /// A provider's `Retry-After` is honoured up to this.
    pub retry_after_max_ms: u64,
}

/// The defaults: 500 ms doubling to 30 s, 8 retries in a row (a worst case of about 64 s of
/// waiting), `Retry-After` honoured up to 60 s.
pub const DEFAULT: Retry = Retry {
    base_ms: 500,
    cap_ms: 30_000,
    retries_max: 8,
    retry_after_max_ms: 60_000,
};

/// The most `retries_max` may be (a config asking for more is refused at load).
pub const RETRIES_MAX: u32 = 100;

impl Default for Retry {
    fn default() -> Self {
        DEFAULT
    }
}

/// A trajectory backing off after a failed model call (or a fence that could not be read):
/// no turn before `until_ms`. Journalled with the record; cleared by the next reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Backoff {
    /// Failures in a row so far (this retry's number).
    pub failures: u32,
    /// The wait chosen for this retry.
    pub delay_ms: u64,
    /// No turn before this (Unix ms).
    pub until_ms: u64,
    /// What failed.
    pub error: String,
}

impl Retry {
    /// The ceiling of retry number `failures` (1 for the first): `base · 2^(failures−1)`, at
    /// most `cap_ms`.
    pub fn ceiling_ms(&self, failures: u32) -> u64 {
        let doublings = failures.saturating_sub(1).min(63);
        self.base_ms
            .saturating_mul(1u64 << doublings)
            .min(self.cap_ms)
    }

    /// The wait before retry number `failures`: full jitter (`draw / u32::MAX` of the ceiling),
    /// and never less than the provider's `retry_after_ms` (capped by `retry_after_max_ms`).
    pub fn delay_ms(&self, failures: u32, retry_after_ms: Option<u64>, draw: u32) -> u64 {
        let ceiling = self.ceiling_ms(failures);
        let jitter = u128::from(ceiling) * u128::from(draw) / u128::from(u32::MAX);
        let jitter = u64::try_from(jitter).expect("at most the ceiling");
        debug_assert!(jitter <= ceiling);
        let floor = retry_after_ms.map_or(0, |r| r.min(self.retry_after_max_ms));
        jitter.max(floor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ceiling_doubles_up_to_the_cap_and_the_jitter_stays_under_it() {
        let r = Retry {
            base_ms: 100,
            cap_ms: 1_000,
            retries_max: 20,
            retry_after_max_ms: 5_000,
        };
        let ceilings: Vec<u64> = (1..=6).map(|n| r.ceiling_ms(n)).collect();
        assert_eq!(ceilings, [100, 200, 400, 800, 1_000, 1_000]);
        assert_eq!(r.ceiling_ms(u32::MAX), 1_000, "no overflow");
        for n in 1..=6 {
            assert_eq!(r.delay_ms(n, None, 0), 0);
            assert_eq!(r.delay_ms(n, None, u32::MAX), r.ceiling_ms(n));
            assert!(r.delay_ms(n, None, u32::MAX / 2) <= r.ceiling_ms(n) / 2 + 1);
        }
        // Retry-After is a floor, capped.
        assert_eq!(r.delay_ms(1, Some(1_000), 0), 1_000);
        assert_eq!(r.delay_ms(1, Some(60_000), 0), 5_000);
        assert_eq!(r.delay_ms(5, Some(10), u32::MAX), 1_000);
    }
}
