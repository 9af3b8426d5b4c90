//! The turn scheduler (seed 004, "Scheduling concurrent trajectories"): weighted deficit
//! round-robin over the READY trajectories by priority class, charged by each turn's estimated
//! tokens, behind a local token bucket set under the provider's TPM/RPM. Only READY
//! trajectories are queued: a waiting one holds no worker and earns no credit, and a class
//! whose queue empties loses its deficit (no hoarding, then a burst).

use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// A trajectory's scheduling class (`estop agent run --class`), recorded in its record.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    Interactive,
    #[default]
    Standard,
    Batch,
}

impl Class {
    pub const ALL: [Class; 3] = [Class::Interactive, Class::Standard, Class::Batch];

    pub fn as_str(self) -> &'static str {
        match self {
            Class::Interactive => "interactive",
            Class::Standard => "standard",
            Class::Batch => "batch",
        }
    }

    /// `interactive`, `standard` or `batch`.
    pub fn parse(s: &str) -> Option<Class> {
        Class::ALL.into_iter().find(|c| c.as_str() == s)
    }

    /// The default class is not written in a record (records from before classes read as it).
    pub fn is_standard(&self) -> bool {
        *self == Class::Standard
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// A local bucket of tokens and requests per minute, refilled continuously; it makes the
/// harness the one that decides who waits, rather than a provider's 429.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    tpm: u64,
    rpm: u64,
    tokens: f64,
    requests: f64,
    at_ms: u64,
}

impl TokenBucket {
    /// Full at `now_ms`.
    pub fn new(tpm: u64, rpm: u64, now_ms: u64) -> TokenBucket {
        assert!(tpm > 0 && rpm > 0, "a bucket with no rate never admits");
        TokenBucket {
            tpm,
            rpm,
            tokens: tpm as f64,
            requests: rpm as f64,
            at_ms: now_ms,
        }
    }

    fn refill(&mut self, now_ms: u64) {
        let dt = now_ms.saturating_sub(self.at_ms) as f64;
        self.tokens = (self.tokens + dt * self.tpm as f64 / 60_000.0).min(self.tpm as f64);
        self.requests = (self.requests + dt * self.rpm as f64 / 60_000.0).min(self.rpm as f64);
        self.at_ms = self.at_ms.max(now_ms);
    }

    /// A cost above one minute's tokens is taken as one minute's, so it can ever pass.
    fn fits(&mut self, now_ms: u64, cost: u64) -> bool {
        self.refill(now_ms);
        self.tokens >= cost.min(self.tpm) as f64 && self.requests >= 1.0
    }

    fn take(&mut self, cost: u64) {
        self.tokens -= cost.min(self.tpm) as f64;
        self.requests -= 1.0;
    }

    /// When a call of `cost` tokens fits, at the earliest.
    pub fn ready_at(&mut self, now_ms: u64, cost: u64) -> u64 {
        self.refill(now_ms);
        let need_t =
            (cost.min(self.tpm) as f64 - self.tokens).max(0.0) * 60_000.0 / self.tpm as f64;
        let need_r = (1.0 - self.requests).max(0.0) * 60_000.0 / self.rpm as f64;
        now_ms + need_t.max(need_r).ceil() as u64
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Weights {
    pub interactive: u64,
    pub standard: u64,
    pub batch: u64,
}

impl Default for Weights {
    /// Seed 004, figure 7: interactive 4, standard 2, batch 1.
    fn default() -> Weights {
        Weights {
            interactive: 4,
            standard: 2,
            batch: 1,
        }
    }
}

impl Weights {
    pub fn of(&self, c: Class) -> u64 {
        match c {
            Class::Interactive => self.interactive,
            Class::Standard => self.standard,
            Class::Batch => self.batch,
        }
    }
}

/// What the scheduler says next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next<T> {
    /// Run this trajectory's turn now.
    Run(T),
    /// Work is queued but the bucket is empty: ask again at this time.
    Wait { until_ms: u64 },
    /// Nothing is READY.
    Idle,
}

#[derive(Debug)]
struct Queue<T> {
    items: VecDeque<(T, u64)>,
    deficit: u64,
}

/// Weighted deficit round-robin across the classes; FIFO within a class.
#[derive(Debug)]
pub struct Scheduler<T> {
    queues: [Queue<T>; 3],
    weights: Weights,
    quantum: u64,
    /// The class being visited, and whether its quantum was already added this visit.
    at: usize,
    topped: bool,
    bucket: TokenBucket,
}

impl<T: Clone + PartialEq> Scheduler<T> {
    /// `quantum` tokens of credit per unit of weight per round.
    pub fn new(weights: Weights, quantum: u64, bucket: TokenBucket) -> Scheduler<T> {
        assert!(quantum > 0 && Class::ALL.iter().all(|c| weights.of(*c) > 0));
        let q = || Queue {
            items: VecDeque::new(),
            deficit: 0,
        };
        Scheduler {
            queues: [q(), q(), q()],
            weights,
            quantum,
            at: 0,
            topped: false,
            bucket,
        }
    }

    /// A trajectory became READY, with its next turn's estimated tokens.
    pub fn push(&mut self, id: T, class: Class, est_tokens: u64) {
        self.queues[class.index()]
            .items
            .push_back((id, est_tokens.max(1)));
    }

    /// A queued trajectory left READY without a turn (paused, cancelled): no credit kept.
    pub fn remove(&mut self, id: &T) {
        for (i, q) in self.queues.iter_mut().enumerate() {
            q.items.retain(|(x, _)| x != id);
            if q.items.is_empty() {
                q.deficit = 0;
                if i == self.at {
                    self.topped = false;
                }
            }
        }
    }

    pub fn len(&self) -> usize {
        self.queues.iter().map(|q| q.items.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The deficit a class holds now (for tests and the console).
    pub fn deficit(&self, class: Class) -> u64 {
        self.queues[class.index()].deficit
    }

    /// The next turn to run, by deficit round-robin; a turn the bucket cannot pay for yet
    /// waits (keeping its place and its class's deficit).
    pub fn next(&mut self, now_ms: u64) -> Next<T> {
        if self.is_empty() {
            return Next::Idle;
        }
        // Each class is visited at most twice before a pick: enough for every deficit to
        // grow by a quantum, and the costliest head needs at most cost / quantum rounds.
        loop {
            let w = self.weights.of(Class::ALL[self.at]);
            let q = &mut self.queues[self.at];
            if q.items.is_empty() {
                q.deficit = 0;
                self.advance();
                continue;
            }
            if !self.topped {
                q.deficit += w * self.quantum;
                self.topped = true;
            }
            let cost = q.items[0].1;
            if cost <= q.deficit {
                if !self.bucket.fits(now_ms, cost) {
                    return Next::Wait {
                        until_ms: self.bucket.ready_at(now_ms, cost),
                    };
                }
                self.bucket.take(cost);
                let q = &mut self.queues[self.at];
                q.deficit -= cost;
                let (id, _) = q.items.pop_front().expect("not empty");
                if q.items.is_empty() {
                    q.deficit = 0;
                    self.advance();
                }
                return Next::Run(id);
            }
            self.advance();
        }
    }

    fn advance(&mut self) {
        self.at = (self.at + 1) % 3;
        self.topped = false;
    }
}
