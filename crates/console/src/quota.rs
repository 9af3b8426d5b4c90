//! Shares of a console pool (sessions, event streams) per principal, with a part reserved for
//! operators: however many agents log in or open streams, an operator still gets one. The rule
//! is one pure function (`Shares::admit`); `Counted` applies it to a pool of RAII slots.

use estop_kernel::{Principal, Role};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The bounds of one pool.
#[derive(Debug, Clone, Copy)]
pub struct Shares {
    /// Slots in the pool.
    pub total_max: usize,
    /// Slots one principal may hold.
    pub per_principal_max: usize,
    /// Slots only operators may take: principals of any other role together hold at most
    /// `total_max - operator_reserve`.
    pub operator_reserve: usize,
}

/// Why a slot was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Full {
    /// The principal holds `per_principal_max` already.
    Principal(usize),
    /// Non-operators hold their whole share (`total_max - operator_reserve`).
    Agents(usize),
    /// The pool is full.
    Total(usize),
}

impl Shares {
    /// Principals other than operators may hold this many slots together.
    pub fn agents_max(&self) -> usize {
        self.total_max.saturating_sub(self.operator_reserve)
    }

    /// Whether `operator` (or not) may take one more slot, given what is held: `total` in the
    /// pool, `agents` by non-operators, `mine` by this principal.
    pub fn admit(
        &self,
        operator: bool,
        total: usize,
        agents: usize,
        mine: usize,
    ) -> Result<(), Full> {
        if mine >= self.per_principal_max {
            return Err(Full::Principal(self.per_principal_max));
        }
        if !operator && agents >= self.agents_max() {
            return Err(Full::Agents(self.agents_max()));
        }
        if total >= self.total_max {
            return Err(Full::Total(self.total_max));
        }
        Ok(())
    }
}

pub fn is_operator(p: &Principal) -> bool {
    p.role == Role::Operator
}

#[derive(Debug, Default)]
struct Held {
    total: usize,
    agents: usize,
    by: HashMap<String, usize>,
}

/// A pool of slots counted per principal; a slot is given back when its `Slot` is dropped.
#[derive(Debug)]
pub struct Counted {
    pub shares: Shares,
    held: Mutex<Held>,
}

/// One slot of a `Counted` pool.
#[derive(Debug)]
pub struct Slot {
    pool: Arc<Counted>,
    name: String,
    operator: bool,
}

impl Counted {
    pub fn new(shares: Shares) -> Arc<Counted> {
        Arc::new(Counted {
            shares,
            held: Mutex::new(Held::default()),
        })
    }

    pub fn take(self: &Arc<Self>, p: &Principal) -> Result<Slot, Full> {
        let operator = is_operator(p);
        let mut h = self.held.lock().expect("quota lock");
        let mine = h.by.get(p.name.as_str()).copied().unwrap_or(0);
        self.shares.admit(operator, h.total, h.agents, mine)?;
        h.total += 1;
        if !operator {
            h.agents += 1;
        }
        *h.by.entry(p.name.as_str().to_string()).or_insert(0) += 1;
        Ok(Slot {
            pool: Arc::clone(self),
            name: p.name.as_str().to_string(),
            operator,
        })
    }

    /// Slots held now.
    pub fn open(&self) -> usize {
        self.held.lock().expect("quota lock").total
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut h = self.pool.held.lock().expect("quota lock");
        h.total -= 1;
        if !self.operator {
            h.agents -= 1;
        }
        if let Some(n) = h.by.get_mut(&self.name) {
            *n -= 1;
            if *n == 0 {
                h.by.remove(&self.name);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use estop_kernel::PrincipalName;

    fn who(name: &str, role: Role) -> Principal {
        Principal {
            name: PrincipalName::new(name).unwrap(),
            role,
            groups: Vec::new(),
        }
    }

    #[test]
    fn a_principal_is_held_to_its_share_and_operators_keep_their_reserve() {
        let pool = Counted::new(Shares {
            total_max: 6,
            per_principal_max: 2,
            operator_reserve: 2,
        });
        let mut slots = Vec::new();
        for a in ["a", "b"] {
            for _ in 0..2 {
                slots.push(pool.take(&who(a, Role::Agent)).unwrap());
            }
        }
        assert_eq!(
            pool.take(&who("a", Role::Agent)).unwrap_err(),
            Full::Principal(2)
        );
        assert_eq!(
            pool.take(&who("c", Role::Agent)).unwrap_err(),
            Full::Agents(4)
        );
        slots.push(pool.take(&who("admin", Role::Operator)).unwrap());
        slots.push(pool.take(&who("root", Role::Operator)).unwrap());
        assert_eq!(
            pool.take(&who("ops", Role::Operator)).unwrap_err(),
            Full::Total(6)
        );
        assert_eq!(pool.open(), 6);
        slots.truncate(1);
        assert_eq!(pool.open(), 1);
        pool.take(&who("c", Role::Agent)).unwrap();
        assert_eq!(pool.open(), 1, "a dropped slot is given back");
    }
}
