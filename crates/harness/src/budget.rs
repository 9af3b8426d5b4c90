//! Per-trajectory budgets (seed 004, "Budgets and ceilings"): a limit vector over turns,
//! tokens, wall clock and dollars, spend metered from the provider's usage report (never from
//! the model's word), a reservation before each call settled after it, and the staged
//! escalation — steer at 70%, restrict at 90%, stop at 100% naming the binding dimension.

use serde::{Deserialize, Serialize};

/// One dimension of the budget vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dimension {
    Turns,
    Tokens,
    WallClock,
    Dollars,
}

impl Dimension {
    pub fn as_str(self) -> &'static str {
        match self {
            Dimension::Turns => "turns",
            Dimension::Tokens => "tokens",
            Dimension::WallClock => "wall_clock",
            Dimension::Dollars => "dollars",
        }
    }
}

/// The ceilings; `None` is no limit in that dimension.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    pub turns_max: Option<u64>,
    pub tokens_max: Option<u64>,
    pub wall_ms_max: Option<u64>,
    pub usd_micros_max: Option<u64>,
}

/// Prices in micro-dollars per token (= dollars per million tokens).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Prices {
    pub input: f64,
    pub cached_input: f64,
    pub output: f64,
}

impl Prices {
    /// The cost of a usage, rounded up to the micro-dollar (a budget errs on the safe side).
    pub fn cost_micros(&self, u: &Usage) -> u64 {
        let c = self.input * u.uncached_input as f64
            + self.cached_input * u.cached_input as f64
            + self.output * u.output as f64;
        c.ceil() as u64
    }
}

/// What the provider reported for one call, split as it prices it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub uncached_input: u64,
    pub cached_input: u64,
    pub output: u64,
}

impl Usage {
    pub fn total(&self) -> u64 {
        self.uncached_input + self.cached_input + self.output
    }
}

/// Measured spend so far (settled calls only).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spend {
    pub turns: u64,
    pub uncached_input: u64,
    pub cached_input: u64,
    pub output: u64,
    pub usd_micros: u64,
}

impl Spend {
    pub fn tokens(&self) -> u64 {
        self.uncached_input + self.cached_input + self.output
    }
}

/// The worst case of one call, held against the budget until the call settles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    pub tokens: u64,
    pub usd_micros: u64,
    /// The output bound to send (`max_tokens`), lowered to what the budget still allows.
    pub max_output_tokens: u64,
}

/// The staged escalation of seed 004's table, by the fraction used of the tightest ceiling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "stage", rename_all = "snake_case")]
pub enum Stage {
    Normal,
    /// ρ in [0.70, 0.90): a notice in the next call.
    Steer {
        binding: Dimension,
        permille: u64,
    },
    /// ρ in [0.90, 1.00): read-only tools, no new sub-agents, ask for a final answer.
    Restrict {
        binding: Dimension,
        permille: u64,
    },
    /// ρ ≥ 1: FINALIZING with BUDGET_EXCEEDED naming the dimension.
    Stop {
        binding: Dimension,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("budget exceeded: {}", .0.as_str())]
pub struct Exceeded(pub Dimension);

/// A trajectory's budget: its ceilings, prices, spend and the reservation in flight.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Budget {
    pub limits: Limits,
    pub prices: Prices,
    pub spend: Spend,
    /// When the trajectory started (Unix ms): wall clock is measured from here.
    pub started_at_ms: u64,
    pub reserved: Option<Reservation>,
    /// Time spent awaiting a human's approval, in waits that ended (ms); not wall clock spent
    /// (seed 004: a reviewer's time is not the agent's compute).
    #[serde(default)]
    pub review_ms: u64,
    /// When the approval wait in progress began (Unix ms), if one is.
    #[serde(default)]
    pub review_since_ms: Option<u64>,
    /// The ceilings carved out for each sub-agent still running, by its trajectory id: held
    /// against this budget (turns, tokens, dollars) until it ends and its measured spend
    /// replaces them ([`Budget::carve`], [`Budget::absorb`]).
    #[serde(default)]
    pub carved: std::collections::BTreeMap<String, Limits>,
}

impl Budget {
    pub fn new(limits: Limits, prices: Prices, started_at_ms: u64) -> Budget {
        Budget {
            limits,
            prices,
            spend: Spend::default(),
            started_at_ms,
            reserved: None,
            review_ms: 0,
            review_since_ms: None,
            carved: std::collections::BTreeMap::new(),
        }
    }

    /// What the running sub-agents hold: (turns, tokens, micro-dollars).
    fn held_by_children(&self) -> (u64, u64, u64) {
        self.carved.values().fold((0, 0, 0), |(t, k, u), l| {
            (
                t + l.turns_max.unwrap_or(0),
                k + l.tokens_max.unwrap_or(0),
                u + l.usd_micros_max.unwrap_or(0),
            )
        })
    }

    /// Carves sub-agent `child`'s budget out of what is left: in each dimension with a
    /// ceiling, `share_permille` of the remainder (the wall clock too, which is not held: the
    /// child's time runs beside the parent's); no ceiling stays no ceiling. The turns, tokens
    /// and dollars carved are held here until [`Budget::absorb`]. A dimension left with
    /// nothing to give refuses, naming it, and nothing is carved.
    pub fn carve(
        &mut self,
        now_ms: u64,
        child: &str,
        share_permille: u64,
    ) -> Result<Limits, Exceeded> {
        let share = |d: Dimension, max: Option<u64>| -> Result<Option<u64>, Exceeded> {
            let Some(max) = max else { return Ok(None) };
            let left = max.saturating_sub(self.used(d, now_ms));
            let part = (left as u128 * share_permille.min(1000) as u128 / 1000) as u64;
            if part == 0 {
                return Err(Exceeded(d));
            }
            Ok(Some(part))
        };
        let l = self.limits;
        let carved = Limits {
            turns_max: share(Dimension::Turns, l.turns_max)?,
            tokens_max: share(Dimension::Tokens, l.tokens_max)?,
            wall_ms_max: share(Dimension::WallClock, l.wall_ms_max)?,
            usd_micros_max: share(Dimension::Dollars, l.usd_micros_max)?,
        };
        self.carved.insert(child.to_string(), carved);
        Ok(carved)
    }

    /// Sub-agent `child` ended: what was carved for it is released and its measured spend
    /// (its own sub-agents' included) becomes this budget's. Once per child: a second call
    /// (a resume that delivers again) changes nothing and says so.
    pub fn absorb(&mut self, child: &str, spend: Spend) -> bool {
        if self.carved.remove(child).is_none() {
            return false;
        }
        self.spend.turns += spend.turns;
        self.spend.uncached_input += spend.uncached_input;
        self.spend.cached_input += spend.cached_input;
        self.spend.output += spend.output;
        self.spend.usd_micros += spend.usd_micros;
        true
    }

    /// Keeps the review time: a wait begins at `now_ms` when `awaiting` and none is in
    /// progress; the wait in progress ends at `now_ms` when not.
    pub fn note_review(&mut self, now_ms: u64, awaiting: bool) {
        match (awaiting, self.review_since_ms) {
            (true, None) => self.review_since_ms = Some(now_ms),
            (false, Some(since)) => {
                self.review_ms += now_ms.saturating_sub(since);
                self.review_since_ms = None;
            }
            _ => {}
        }
    }

    /// The wall clock spent by `now_ms`: since the start, less the time awaiting approval.
    pub fn wall_ms(&self, now_ms: u64) -> u64 {
        let waiting = self
            .review_since_ms
            .map_or(0, |since| now_ms.saturating_sub(since));
        now_ms
            .saturating_sub(self.started_at_ms)
            .saturating_sub(self.review_ms + waiting)
    }

    fn used(&self, d: Dimension, now_ms: u64) -> u64 {
        let (turns, tokens, usd) = self.held_by_children();
        match d {
            Dimension::Turns => self.spend.turns + turns,
            Dimension::Tokens => self.spend.tokens() + tokens,
            Dimension::WallClock => self.wall_ms(now_ms),
            Dimension::Dollars => self.spend.usd_micros + usd,
        }
    }

    fn limit(&self, d: Dimension) -> Option<u64> {
        match d {
            Dimension::Turns => self.limits.turns_max,
            Dimension::Tokens => self.limits.tokens_max,
            Dimension::WallClock => self.limits.wall_ms_max,
            Dimension::Dollars => self.limits.usd_micros_max,
        }
    }

    /// ρ in per-mille and the dimension that binds (the first of the tightest, in
    /// [`Dimension`] order); `None` without any limit.
    pub fn rho(&self, now_ms: u64) -> Option<(Dimension, u64)> {
        let dims = [
            Dimension::Turns,
            Dimension::Tokens,
            Dimension::WallClock,
            Dimension::Dollars,
        ];
        let mut best: Option<(Dimension, u64)> = None;
        for d in dims {
            let Some(max) = self.limit(d) else { continue };
            let used = self.used(d, now_ms) as u128;
            let permille = if max == 0 {
                1000
            } else {
                (used * 1000 / max as u128).min(u64::MAX as u128) as u64
            };
            if best.is_none_or(|(_, p)| permille > p) {
                best = Some((d, permille));
            }
        }
        best
    }

    pub fn stage(&self, now_ms: u64) -> Stage {
        match self.rho(now_ms) {
            None => Stage::Normal,
            Some((binding, p)) if p >= 1000 => Stage::Stop { binding },
            Some((binding, permille)) if permille >= 900 => Stage::Restrict { binding, permille },
            Some((binding, permille)) if permille >= 700 => Stage::Steer { binding, permille },
            Some(_) => Stage::Normal,
        }
    }

    /// Reserves one call's worst case: the prompt estimate plus `max_output` tokens, priced as
    /// uncached input and output. The output bound is lowered to what the token and dollar
    /// ceilings leave; a call for which not one output token is left is refused, naming the
    /// dimension, and nothing is reserved. Counts the turn.
    pub fn reserve(
        &mut self,
        now_ms: u64,
        prompt_estimate: u64,
        max_output: u64,
    ) -> Result<Reservation, Exceeded> {
        assert!(self.reserved.is_none(), "one call in flight per trajectory");
        if let Stage::Stop { binding } = self.stage(now_ms) {
            return Err(Exceeded(binding));
        }
        let mut out = max_output;
        let (_, child_tokens, child_usd) = self.held_by_children();
        if let Some(max) = self.limits.tokens_max {
            let left = max.saturating_sub(self.spend.tokens() + child_tokens + prompt_estimate);
            out = out.min(left);
            if out == 0 {
                return Err(Exceeded(Dimension::Tokens));
            }
        }
        let prompt_usd = self.prices.input * prompt_estimate as f64;
        if let Some(max) = self.limits.usd_micros_max {
            let left = max as f64 - (self.spend.usd_micros + child_usd) as f64 - prompt_usd;
            if self.prices.output > 0.0 {
                let fits = (left / self.prices.output).floor();
                out = out.min(if fits > 0.0 { fits as u64 } else { 0 });
            }
            if out == 0 || left <= 0.0 {
                return Err(Exceeded(Dimension::Dollars));
            }
        }
        let worst = Usage {
            uncached_input: prompt_estimate,
            cached_input: 0,
            output: out,
        };
        let r = Reservation {
            tokens: worst.total(),
            usd_micros: self.prices.cost_micros(&worst),
            max_output_tokens: out,
        };
        self.spend.turns += 1;
        self.reserved = Some(r);
        Ok(r)
    }

    /// Settles the call in flight on the provider's usage; a call that reported none (a cut
    /// stream, a failure mid-body) is charged its whole reservation.
    pub fn settle(&mut self, usage: Option<Usage>) {
        let r = self.reserved.take().expect("settle follows reserve");
        match usage {
            Some(u) => {
                self.spend.uncached_input += u.uncached_input;
                self.spend.cached_input += u.cached_input;
                self.spend.output += u.output;
                self.spend.usd_micros += self.prices.cost_micros(&u);
            }
            None => {
                self.spend.uncached_input += r.tokens - r.max_output_tokens;
                self.spend.output += r.max_output_tokens;
                self.spend.usd_micros += r.usd_micros;
            }
        }
    }

    /// A direct cost of a tool call (a paid search), in micro-dollars.
    pub fn charge_tool(&mut self, usd_micros: u64) {
        self.spend.usd_micros += usd_micros;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(limits: Limits) -> Budget {
        let prices = Prices {
            input: 3.0,
            cached_input: 0.3,
            output: 15.0,
        };
        Budget::new(limits, prices, 1_000)
    }

    /// Seed 004's worked example: 30 of 40 turns, 460 of 900 s, $0.50 of $3.50 with the cache,
    /// 898,500 of 2M tokens → turns bind at 75% (steer).
    #[test]
    fn the_tightest_ceiling_binds() {
        let mut b = budget(Limits {
            turns_max: Some(40),
            tokens_max: Some(2_000_000),
            wall_ms_max: Some(900_000),
            usd_micros_max: Some(3_500_000),
        });
        b.spend = Spend {
            turns: 30,
            uncached_input: 100_000,
            cached_input: 790_000,
            output: 8_500,
            usd_micros: 500_000,
        };
        let now = 1_000 + 460_000;
        assert_eq!(b.rho(now), Some((Dimension::Turns, 750)));
        assert_eq!(
            b.stage(now),
            Stage::Steer {
                binding: Dimension::Turns,
                permille: 750
            }
        );
        // Without the cache the same tokens cost $2.77: dollars bind at 79.1%.
        b.spend.usd_micros = 2_770_000;
        assert_eq!(b.rho(now), Some((Dimension::Dollars, 791)));
    }

    #[test]
    fn stages_follow_the_thresholds() {
        let mut b = budget(Limits {
            turns_max: Some(10),
            ..Limits::default()
        });
        let stage_at = |b: &mut Budget, t| {
            b.spend.turns = t;
            b.stage(0)
        };
        assert_eq!(stage_at(&mut b, 6), Stage::Normal);
        assert!(matches!(stage_at(&mut b, 7), Stage::Steer { .. }));
        assert!(matches!(stage_at(&mut b, 9), Stage::Restrict { .. }));
        assert_eq!(
            stage_at(&mut b, 10),
            Stage::Stop {
                binding: Dimension::Turns
            }
        );
    }

    #[test]
    fn a_reservation_is_lowered_to_what_is_left_then_refused() {
        let mut b = budget(Limits {
            tokens_max: Some(1_000),
            ..Limits::default()
        });
        let r = b.reserve(0, 600, 4_096).unwrap();
        assert_eq!(r.max_output_tokens, 400);
        b.settle(Some(Usage {
            uncached_input: 600,
            cached_input: 0,
            output: 399,
        }));
        assert_eq!(b.spend.tokens(), 999);
        assert_eq!(b.reserve(0, 1, 10), Err(Exceeded(Dimension::Tokens)));
        assert_eq!(b.reserved, None, "a refused reservation holds nothing");
    }

    #[test]
    fn dollars_bound_the_output_and_a_cut_call_pays_its_reservation() {
        let mut b = budget(Limits {
            usd_micros_max: Some(1_000),
            ..Limits::default()
        });
        // 100 prompt tokens at 3 µ$ = 300 µ$; 700 µ$ left at 15 µ$ per output token = 46.
        let r = b.reserve(0, 100, 4_096).unwrap();
        assert_eq!(r.max_output_tokens, 46);
        b.settle(None);
        assert_eq!(b.spend.usd_micros, 300 + 46 * 15);
        assert_eq!(b.spend.output, 46);
        assert_eq!(b.reserve(0, 1, 10), Err(Exceeded(Dimension::Dollars)));
    }

    #[test]
    fn usage_is_priced_by_kind() {
        let p = Prices {
            input: 3.0,
            cached_input: 0.3,
            output: 15.0,
        };
        let u = Usage {
            uncached_input: 1_000,
            cached_input: 10_000,
            output: 100,
        };
        assert_eq!(p.cost_micros(&u), 3_000 + 3_000 + 1_500);
    }

    /// A sub-agent's budget is a share of what is left, held against the parent until the
    /// child ends and its spend replaces it (once); two children never share the same room.
    #[test]
    fn a_sub_agents_budget_is_carved_from_what_is_left_and_absorbed_once() {
        let mut b = budget(Limits {
            turns_max: Some(10),
            tokens_max: Some(1000),
            wall_ms_max: None,
            usd_micros_max: Some(100),
        });
        b.spend.turns = 2;
        b.spend.output = 200;
        let first = b.carve(0, "p/c1", 500).unwrap();
        assert_eq!(
            (
                first.turns_max,
                first.tokens_max,
                first.wall_ms_max,
                first.usd_micros_max
            ),
            (Some(4), Some(400), None, Some(50))
        );
        // The second carve sees the first one held: half of what is left after it.
        let second = b.carve(0, "p/c2", 500).unwrap();
        assert_eq!((second.turns_max, second.tokens_max), (Some(2), Some(200)));
        assert_eq!(b.rho(0), Some((Dimension::Turns, 800)));
        let spent = Spend {
            turns: 1,
            output: 30,
            usd_micros: 7,
            ..Spend::default()
        };
        assert!(b.absorb("p/c1", spent));
        assert!(!b.absorb("p/c1", spent), "absorbed once");
        assert_eq!(
            (b.spend.turns, b.spend.output, b.spend.usd_micros),
            (3, 230, 7)
        );
        // Nothing left in a dimension: refused, naming it, nothing carved.
        b.spend.usd_micros = 100;
        assert_eq!(b.carve(0, "p/c3", 500), Err(Exceeded(Dimension::Dollars)));
        assert!(!b.carved.contains_key("p/c3"));
    }
}
