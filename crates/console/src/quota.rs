//! The console's pools (event streams) counted per principal, with a part reserved for
//! operators. The rule is the daemon's own, `estop_server::quota::ShareOptions::admit` (the
//! session pool in `auth` applies it too); `Counted` holds it over a pool of RAII slots.

use estop_kernel::{Principal, Role};
pub use estop_server::quota::{Full, ShareOptions};
use std::sync::{Arc, Mutex};

pub fn is_operator(p: &Principal) -> bool {
    p.role == Role::Operator
}

/// A pool of slots counted per principal; a slot is given back when its `Slot` is dropped.
#[derive(Debug)]
pub struct Counted {
    held: Mutex<estop_server::quota::Shares>,
}

/// One slot of a `Counted` pool.
#[derive(Debug)]
pub struct Slot {
    pool: Arc<Counted>,
    holder: Principal,
}

impl Counted {
    pub fn new(shares: ShareOptions) -> Arc<Counted> {
        Arc::new(Counted {
            held: Mutex::new(estop_server::quota::Shares::new("event_streams", shares)),
        })
    }

    pub fn take(self: &Arc<Self>, p: &Principal) -> Result<Slot, Full> {
        self.held.lock().expect("quota lock").try_take(p)?;
        Ok(Slot {
            pool: Arc::clone(self),
            holder: p.clone(),
        })
    }

    /// Slots held now.
    pub fn open(&self) -> usize {
        self.held.lock().expect("quota lock").total()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.pool
            .held
            .lock()
            .expect("quota lock")
            .give_back(&self.holder);
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
            part: Default::default(),
        }
    }

    #[test]
    fn a_principal_is_held_to_its_share_and_operators_keep_their_reserve() {
        let pool = Counted::new(ShareOptions {
            max: 6,
            per_principal_max: 2,
            per_token_max: 6,
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
            Full::Others(4)
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
