//! The gate's clock: wall-clock milliseconds (what the ledger records, and what deadlines and
//! expiries are written in), never going backwards and never pushed into the future by one bad
//! reading. Pure: each reading is given the wall clock and a monotonic clock, so it is tested
//! as data.
//!
//! * A wall clock that agrees with the monotonic estimate (within [`STEP_MS_MAX`]) is followed.
//! * A forward step beyond that is believed only once it has persisted for
//!   [`STEP_CONFIRM_MS`] of monotonic time (an NTP correction does; a glitch does not). Until
//!   then the gate's time advances with the monotonic clock.
//! * A backward step is never followed (time handed out never decreases), but the gate's time
//!   keeps advancing, at half speed, until the wall clock catches up: approvals still expire and
//!   deadlines still fire, and the two converge.

/// A wall clock ahead of the monotonic estimate by more than this is a step, not drift.
pub const STEP_MS_MAX: u64 = 1_000;
/// A forward step is believed after it has persisted this long.
pub const STEP_CONFIRM_MS: u64 = 30_000;

#[derive(Debug, Default, Clone)]
pub struct Clock {
    /// The last time handed out, and the monotonic reading that went with it.
    last: Option<(u64, u64)>,
    /// Since when (monotonic) the wall clock has been ahead of the estimate by a step.
    step_since: Option<u64>,
    /// While the wall clock is behind: the gate's time and the monotonic reading when it fell
    /// behind (half speed is counted from there, so frequent readings still advance).
    behind_since: Option<(u64, u64)>,
}

impl Clock {
    /// The gate's time now, given the wall clock and a monotonic clock (both in ms).
    pub fn read(&mut self, wall_ms: u64, mono_ms: u64) -> u64 {
        let Some((now, at)) = self.last else {
            self.last = Some((wall_ms, mono_ms));
            return wall_ms;
        };
        let elapsed = mono_ms.saturating_sub(at);
        let estimate = now + elapsed;
        let next = if wall_ms > estimate + STEP_MS_MAX {
            let since = *self.step_since.get_or_insert(mono_ms);
            if mono_ms.saturating_sub(since) >= STEP_CONFIRM_MS {
                self.step_since = None;
                wall_ms
            } else {
                estimate
            }
        } else {
            self.step_since = None;
            if wall_ms >= now {
                self.behind_since = None;
                wall_ms
            } else {
                let (t0, m0) = *self.behind_since.get_or_insert((now, at));
                let half = t0 + mono_ms.saturating_sub(m0) / 2;
                if wall_ms >= half {
                    self.behind_since = None;
                    wall_ms.max(now)
                } else {
                    half.max(now)
                }
            }
        };
        self.last = Some((next, mono_ms));
        next
    }

    /// The last time handed out (0 before the first reading).
    pub fn last(&self) -> u64 {
        self.last.map_or(0, |(now, _)| now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads `(wall, mono)` pairs; returns the times handed out.
    fn run(readings: &[(u64, u64)]) -> Vec<u64> {
        let mut c = Clock::default();
        readings.iter().map(|&(w, m)| c.read(w, m)).collect()
    }

    #[test]
    fn follows_a_wall_clock_that_agrees() {
        assert_eq!(
            run(&[(1_000_000, 0), (1_000_010, 10), (1_000_500, 500)]),
            [1_000_000, 1_000_010, 1_000_500]
        );
    }

    #[test]
    fn one_bad_reading_in_the_future_does_not_stick() {
        let year = 365 * 24 * 3600 * 1000;
        let got = run(&[
            (1_000_000, 0),
            (1_000_000 + year, 10),
            (1_000_020, 20),
            (1_000_030, 30),
        ]);
        assert_eq!(got, [1_000_000, 1_000_010, 1_000_020, 1_000_030]);
    }

    #[test]
    fn a_forward_step_that_persists_is_believed() {
        let step = 3_600_000;
        let mut c = Clock::default();
        assert_eq!(c.read(1_000_000, 0), 1_000_000);
        // Ahead by an hour from now on: followed only after STEP_CONFIRM_MS.
        assert_eq!(c.read(1_000_000 + step + 100, 100), 1_000_100);
        let m = 100 + STEP_CONFIRM_MS - 1;
        assert_eq!(c.read(1_000_000 + step + m, m), 1_000_000 + m);
        let m = 100 + STEP_CONFIRM_MS;
        assert_eq!(c.read(1_000_000 + step + m, m), 1_000_000 + step + m);
    }

    #[test]
    fn a_backward_step_never_goes_back_and_time_still_advances_until_they_meet() {
        let mut c = Clock::default();
        assert_eq!(c.read(1_000_000, 0), 1_000_000);
        // The wall clock steps back by 10 s: the gate's time goes on at half speed.
        assert_eq!(c.read(990_100, 100), 1_000_050);
        assert_eq!(c.read(990_300, 300), 1_000_150);
        let mut last = 1_000_150;
        let mut met = None;
        for m in (400..=40_000).step_by(100) {
            let t = c.read(990_000 + m, m);
            // At least half speed (100 ms of readings apart), never backwards.
            assert!(
                t >= last + 50 || t == 990_000 + m,
                "time advances: {t} after {last}"
            );
            assert!(t >= last);
            last = t;
            if t == 990_000 + m && met.is_none() {
                met = Some(m);
            }
        }
        // Half speed closes a 10 s gap in 20 s of real time.
        assert!(met.is_some_and(|m| m <= 20_500), "met at {met:?}");
    }

    #[test]
    fn behind_the_wall_clock_frequent_readings_still_advance() {
        let mut c = Clock::default();
        assert_eq!(c.read(1_000_000, 0), 1_000_000);
        // Stepped back by 10 s, and read every millisecond.
        let mut t = 0;
        for m in 1..=4_000 {
            t = c.read(990_000 + m, m);
        }
        assert_eq!(t, 1_002_000, "half speed over 4 s of readings");
    }
}
