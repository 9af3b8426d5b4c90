//! Listings (`runs`, `pending`, `report`, `ledger`) come in pages, so no reply is larger than a
//! bound whatever the gate holds. A page ends after `limit` items or once its items reach
//! `page_bytes_max` bytes as rendered, whichever comes first; it holds at least one item, so
//! following the cursor always makes progress. The cursor (`next` in a reply, `cursor` in the
//! request) is an opaque string to clients; this module is where its encoding lives.

use estop_kernel::ids::{EffectKey, RunId};
use serde_json::Value;

use crate::server_line::{Awaiting, Event, LedgerEntry, PendingItem, ReportItem, RunView};

/// Items per page when the request gives no `limit`.
pub const PAGE_ITEMS_DEFAULT: usize = 1000;
/// Most items one page may hold, whatever `limit` asks.
pub const PAGE_ITEMS_MAX: usize = 10_000;
/// Default byte budget of one page (the server may configure another): a page stops once its
/// items reach it, so a few huge items cannot make one giant reply.
pub const PAGE_BYTES_MAX_DEFAULT: usize = 1 << 20;

/// Counts a page's items against its item and byte bounds.
#[derive(Debug, Clone)]
pub struct PageBudget {
    items_left: usize,
    bytes_left: usize,
    empty: bool,
}

impl PageBudget {
    pub fn new(limit: usize, bytes_max: usize) -> PageBudget {
        PageBudget {
            items_left: limit.max(1),
            bytes_left: bytes_max,
            empty: true,
        }
    }

    /// Whether one more item of `weight` bytes fits on the page (the first one always does);
    /// counts it when it does.
    pub fn take(&mut self, weight: usize) -> bool {
        if self.items_left == 0 || (!self.empty && weight > self.bytes_left) {
            return false;
        }
        self.items_left -= 1;
        self.bytes_left = self.bytes_left.saturating_sub(weight);
        self.empty = false;
        true
    }
}

/// About the bytes a value renders to as JSON: an estimate from above for text without
/// escapes, and within a small factor of the memory the value holds.
pub trait Weight {
    fn weight(&self) -> usize;
}

/// Quotes, a comma, a colon: the JSON around a field.
const FIELD: usize = 8;

fn text(s: &str) -> usize {
    s.len() + FIELD
}

fn texts<'a>(it: impl IntoIterator<Item = &'a String>) -> usize {
    it.into_iter().map(|s| text(s)).sum()
}

impl Weight for RunView {
    fn weight(&self) -> usize {
        // Field names, counts and timestamps: ~300 bytes; a budget line's names and three
        // numbers: ~120.
        300 + text(&self.run)
            + text(&self.owner)
            + self.parent.as_deref().map_or(0, text)
            + self.cause.as_deref().map_or(0, text)
            + self.reason.as_deref().map_or(0, text)
            + self
                .budget
                .iter()
                .map(|b| 120 + text(&b.dimension))
                .sum::<usize>()
            + self
                .labels
                .iter()
                .map(|(k, v)| text(k) + text(v))
                .sum::<usize>()
    }
}

impl Weight for PendingItem {
    fn weight(&self) -> usize {
        // Field names, the digest, numbers: ~250 bytes.
        250 + text(&self.approval)
            + text(&self.run)
            + text(&self.key)
            + text(&self.tool)
            + self.args.as_ref().map_or(0, |a| a.get().len())
            + self.rule.as_deref().map_or(0, text)
            + texts(&self.approvals)
            + texts(&self.groups)
            + self.compensates.as_deref().map_or(0, text)
    }
}

impl Weight for Awaiting {
    fn weight(&self) -> usize {
        // Braces and field names: ~40 bytes.
        40 + text(&self.key) + text(&self.status) + self.approval.as_deref().map_or(0, text)
    }
}

impl Weight for ReportItem {
    fn weight(&self) -> usize {
        100 + text(&self.key)
            + text(&self.tool)
            + text(&self.status)
            + text(&self.reversibility)
            + self.compensate.as_deref().map_or(0, text)
            + self.reason.as_deref().map_or(0, text)
            // An undo's attempts and times (~100 bytes), its note and who acted.
            + if self.attempts.is_some() { 100 } else { 0 }
            // A note is free text: escaping may double it.
            + self.note.as_deref().map_or(0, |n| 2 * text(n))
            + self.by.as_deref().map_or(0, text)
            // `"holder":"egress"` and `"disputes":N`.
            + if self.holder.is_some() || self.disputes.is_some() { 48 } else { 0 }
            + self.args.as_ref().map_or(0, |a| a.get().len())
            + if self.http_status.is_some() { 60 } else { 0 }
            + self.error.as_deref().map_or(0, |e| 2 * text(e))
    }
}

impl Weight for LedgerEntry {
    fn weight(&self) -> usize {
        60 + text(&self.kind)
            + self.run.as_deref().map_or(0, text)
            + self.key.as_deref().map_or(0, text)
            + self
                .fields
                .iter()
                .map(|(k, v)| text(k) + value_weight(v))
                .sum::<usize>()
    }
}

impl Weight for Event {
    fn weight(&self) -> usize {
        80 + text(&self.run)
            + self.key.as_deref().map_or(0, text)
            + self.reason.as_deref().map_or(0, text)
            + self.decision.as_deref().map_or(0, text)
            + self.outcome.as_deref().map_or(0, text)
    }
}

/// [`Weight`] of a JSON tree.
pub fn value_weight(v: &Value) -> usize {
    match v {
        Value::Null | Value::Bool(_) | Value::Number(_) => 24,
        Value::String(s) => text(s),
        Value::Array(a) => 2 + a.iter().map(|x| 1 + value_weight(x)).sum::<usize>(),
        Value::Object(m) => {
            2 + m
                .iter()
                .map(|(k, x)| text(k) + value_weight(x))
                .sum::<usize>()
        }
    }
}

/// Where the next page of the inbox starts: after this item in the inbox's order (soonest to
/// expire first, then run, then key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingCursor {
    pub expires_at: u64,
    pub run: RunId,
    pub key: EffectKey,
}

impl PendingCursor {
    pub fn encode(&self) -> String {
        serde_json::to_string(&(self.expires_at, self.run.as_str(), self.key.as_str()))
            .expect("a tuple of a number and strings serializes")
    }

    pub fn decode(s: &str) -> Option<PendingCursor> {
        let (expires_at, run, key): (u64, String, String) = serde_json::from_str(s).ok()?;
        Some(PendingCursor {
            expires_at,
            run: RunId::new(&run).ok()?,
            key: EffectKey::new(&key).ok()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_takes_its_first_item_whatever_its_size_then_stops_at_either_bound() {
        let mut p = PageBudget::new(10, 100);
        assert!(p.take(500), "the first item always fits");
        assert!(!p.take(1), "the budget is spent");
        let mut p = PageBudget::new(2, 100);
        assert!(p.take(40) && p.take(40));
        assert!(!p.take(1), "two items is the limit");
        let mut p = PageBudget::new(10, 100);
        assert!(p.take(60) && !p.take(60) && p.take(40));
    }

    #[test]
    fn a_pending_cursor_round_trips_and_nothing_else_decodes() {
        let c = PendingCursor {
            expires_at: 17,
            run: RunId::new("r \"1\"/é").unwrap(),
            key: EffectKey::new("k,2]").unwrap(),
        };
        assert_eq!(PendingCursor::decode(&c.encode()), Some(c));
        for bad in [
            "",
            "17",
            "[17,\"r\"]",
            "[17,\"\",\"k\"]",
            "[-1,\"r\",\"k\"]",
            "{}",
        ] {
            assert_eq!(PendingCursor::decode(bad), None, "{bad}");
        }
    }
}
