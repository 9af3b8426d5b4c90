//! Per-principal shares of the gate's pools (SPEC §6): no principal may hold more than its share
//! of a pool, no token more than its share with every sandbox that speaks for it (`TOKEN/RUN`,
//! docs/EGRESS.md), and a reserve at the top of every pool is for operators only, so no agent —
//! nor a crowd of them, nor one token's crowd of sandboxes — can take the gate away from the
//! others or lock the operator out.
//!
//! The rule is one pure function, [`ShareOptions::admit`], for every pool of the daemon (the
//! console's sessions and event streams use it too). [`Shares`] is the plain counter (the core
//! owns the waiters' and subscriptions' instances); [`ConnectionSlots`] wraps one for
//! connections, which are counted before they authenticate.

use estop_kernel::{Principal, PrincipalName, Role};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

/// The bounds of one pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareOptions {
    /// What the pool holds at most, operators included.
    pub max: usize,
    /// What one principal may hold.
    pub per_principal_max: usize,
    /// What one token may hold with all its sandboxes' principals together (the kernel's
    /// `runs_per_token_max` for the daemon's own pools): the holder of an agent token may speak
    /// for as many sandboxes as it names runs, each a principal with a full share.
    pub per_token_max: usize,
    /// The top of the pool that only operators may use.
    pub operator_reserve: usize,
}

impl ShareOptions {
    /// `max` with a per-principal share and the operator reserve derived from it: a principal
    /// may take a quarter of the pool (at least 1), a token with its sandboxes half of it (at
    /// least 1), operators keep 1/64 of it (at least 1, at most `reserve_max`).
    pub fn derived(max: usize, reserve_max: usize) -> ShareOptions {
        let operator_reserve = (max / 64).clamp(1, reserve_max.max(1)).min(max);
        ShareOptions {
            max,
            per_principal_max: (max / 4).max(1),
            per_token_max: (max / 2).max(1),
            operator_reserve,
        }
    }

    /// What all principals but operators may hold together.
    pub fn others_max(&self) -> usize {
        self.max.saturating_sub(self.operator_reserve)
    }

    /// Whether a principal (an operator or not) may take one more, given what is held: `total`
    /// in the pool, `others` by principals that are not operators, `mine` by this principal,
    /// `my_token` by its token and every sandbox of it (`mine` where a pool has no sandboxes).
    pub fn admit(
        &self,
        operator: bool,
        total: usize,
        others: usize,
        mine: usize,
        my_token: usize,
    ) -> Result<(), Full> {
        if mine >= self.per_principal_max {
            return Err(Full::Principal(self.per_principal_max));
        }
        if my_token >= self.per_token_max {
            return Err(Full::Token(self.per_token_max));
        }
        if !operator && others >= self.others_max() {
            return Err(Full::Others(self.others_max()));
        }
        if total >= self.max {
            return Err(Full::Total(self.max));
        }
        Ok(())
    }
}

/// Why a pool refused one more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Full {
    /// The principal holds `per_principal_max` already.
    Principal(usize),
    /// The principal's token and its sandboxes hold `per_token_max` already.
    Token(usize),
    /// Principals other than operators hold their whole part (`max - operator_reserve`).
    Others(usize),
    /// The pool is full.
    Total(usize),
}

impl Full {
    /// The refusal's message for pool `what` (`waiters`, …), naming its bound and what to do.
    pub fn message(self, what: &str, p: &Principal, opts: &ShareOptions) -> String {
        match self {
            Full::Principal(n) => format!(
                "limit reached: {what}_per_principal_max = {n} for {}; release some of yours first",
                p.name
            ),
            Full::Token(n) => format!(
                "limit reached: {what}_per_token_max = {n} for the token {} and the sandboxes that speak for it; release some of theirs first",
                p.name.token_name()
            ),
            Full::Others(_) => format!(
                "limit reached: {what}_max = {} with {} reserved for operators; release some, or retry later",
                opts.max, opts.operator_reserve
            ),
            Full::Total(n) => {
                format!("limit reached: {what}_max = {n}; release some (or raise the bound)")
            }
        }
    }
}

/// Who holds how much of one pool.
#[derive(Debug)]
pub struct Shares {
    opts: ShareOptions,
    /// The pool's name in messages (`waiters`, `subscriptions`, `connections`).
    what: &'static str,
    total: usize,
    /// Held by principals that are not operators.
    others: usize,
    /// Held by each principal (operators included).
    of: HashMap<PrincipalName, usize>,
    /// Held by each token with its sandboxes' principals (`PrincipalName::token_name`).
    of_token: HashMap<Box<str>, usize>,
}

impl Shares {
    pub fn new(what: &'static str, opts: ShareOptions) -> Shares {
        Shares {
            opts,
            what,
            total: 0,
            others: 0,
            of: HashMap::new(),
            of_token: HashMap::new(),
        }
    }

    pub fn options(&self) -> ShareOptions {
        self.opts
    }

    /// How much the pool holds in all.
    pub fn total(&self) -> usize {
        self.total
    }

    /// How much `name` holds.
    pub fn held_by(&self, name: &PrincipalName) -> usize {
        self.of.get(name).copied().unwrap_or(0)
    }

    /// Takes one unit for `p`, or says which bound stops it (nothing taken then).
    pub fn take(&mut self, p: &Principal) -> Result<(), String> {
        self.try_take(p)
            .map_err(|full| full.message(self.what, p, &self.opts))
    }

    /// How much `name`'s token holds with all its sandboxes.
    pub fn held_by_token(&self, name: &PrincipalName) -> usize {
        self.of_token.get(name.token_name()).copied().unwrap_or(0)
    }

    /// `take`, with the refusal as data (for a front door that words it its own way).
    pub fn try_take(&mut self, p: &Principal) -> Result<(), Full> {
        let operator = p.role == Role::Operator;
        let mine = self.held_by(&p.name);
        let my_token = self.held_by_token(&p.name);
        self.opts
            .admit(operator, self.total, self.others, mine, my_token)?;
        self.total += 1;
        if !operator {
            self.others += 1;
        }
        *self.of.entry(p.name.clone()).or_default() += 1;
        *self.of_token.entry(p.name.token_name().into()).or_default() += 1;
        Ok(())
    }

    /// Gives back one unit `p` took.
    pub fn give_back(&mut self, p: &Principal) {
        self.total -= 1;
        if p.role != Role::Operator {
            self.others -= 1;
        }
        let n = self.of.get_mut(&p.name).expect("a share taken before");
        *n -= 1;
        if *n == 0 {
            self.of.remove(&p.name);
        }
        let t = self
            .of_token
            .get_mut(p.name.token_name())
            .expect("a token's share taken before");
        *t -= 1;
        if *t == 0 {
            self.of_token.remove(p.name.token_name());
        }
    }
}

/// Bounds of the connection pool of one listener family (v1: Unix socket and TCP).
#[derive(Debug, Clone, Copy)]
pub struct ConnectionOptions {
    pub shares: ShareOptions,
    /// Connections that have not authenticated yet, at most (they must `hello` quickly).
    pub unauthenticated_max: usize,
}

impl ConnectionOptions {
    /// Bounds derived from `connections_max`: a principal may hold a quarter, operators keep a
    /// sixteenth (1 to 64), connections not yet authenticated a quarter (1 to 1024: a client
    /// that opens many connections before it says `hello` on each must not evict its own).
    pub fn derived(connections_max: usize) -> ConnectionOptions {
        let mut shares = ShareOptions::derived(connections_max, 64);
        shares.operator_reserve = (connections_max / 16).clamp(1, 64);
        ConnectionOptions {
            shares,
            unauthenticated_max: (connections_max / 4).clamp(1, 1024),
        }
    }
}

/// The connection pool: every open connection holds a [`Slot`]. A connection is counted from
/// its accept; it takes its principal's share at `hello`. Operators always find room: agents
/// together hold at most `max - operator_reserve - unauthenticated_max`, so neither agents nor
/// connections that never authenticate can fill the reserve.
#[derive(Debug)]
pub struct ConnectionSlots {
    opts: ConnectionOptions,
    state: Mutex<SlotState>,
}

#[derive(Debug)]
struct SlotState {
    shares: Shares,
    /// Connections not yet authenticated, oldest first: the id of each and how to tell it that
    /// it was evicted.
    unauthenticated: VecDeque<(u64, Arc<Notify>)>,
    next_id: u64,
}

impl ConnectionSlots {
    pub fn new(opts: ConnectionOptions) -> Arc<ConnectionSlots> {
        let mut shares = opts.shares;
        // What agents may hold leaves room for the unauthenticated as well as the reserve (but
        // at least one connection, however small the pool).
        shares.operator_reserve = shares
            .operator_reserve
            .saturating_add(opts.unauthenticated_max)
            .min(shares.max.saturating_sub(1));
        Arc::new(ConnectionSlots {
            opts,
            state: Mutex::new(SlotState {
                shares: Shares::new("connections", shares),
                unauthenticated: VecDeque::new(),
                next_id: 0,
            }),
        })
    }

    pub fn options(&self) -> ConnectionOptions {
        self.opts
    }

    /// Open connections.
    pub fn open(&self) -> usize {
        let s = self.state.lock().expect("slots lock");
        s.shares.total() + s.unauthenticated.len()
    }

    /// A slot for a connection just accepted, not yet authenticated. When the connections not
    /// yet authenticated are at their bound, the oldest of them is evicted (told through
    /// [`Slot::evicted`]) to make room: a flood of silent connections then only ever delays a
    /// client that says `hello` at once by the time it takes to open that many connections,
    /// instead of locking it out (the operator's CLI included).
    pub fn accept(self: &Arc<Self>) -> Result<Slot, String> {
        let mut s = self.state.lock().expect("slots lock");
        let max = self.opts.shares.max;
        if s.unauthenticated.len() >= self.opts.unauthenticated_max
            && let Some((_, evict)) = s.unauthenticated.pop_front()
        {
            evict.notify_one();
        }
        if s.shares.total() + s.unauthenticated.len() >= max {
            return Err(format!(
                "limit reached: connections_max = {max}; close idle connections or raise --connections-max"
            ));
        }
        let id = s.next_id;
        s.next_id += 1;
        let evicted = Arc::new(Notify::new());
        s.unauthenticated.push_back((id, Arc::clone(&evicted)));
        Ok(Slot {
            slots: Arc::clone(self),
            id,
            evicted,
            holder: None,
        })
    }
}

impl SlotState {
    /// Forgets unauthenticated connection `id`; false if it was evicted already.
    fn forget_unauthenticated(&mut self, id: u64) -> bool {
        match self.unauthenticated.iter().position(|(i, _)| *i == id) {
            Some(at) => {
                self.unauthenticated.remove(at);
                true
            }
            None => false,
        }
    }
}

/// One connection's place in the pool; given back when dropped.
#[derive(Debug)]
pub struct Slot {
    slots: Arc<ConnectionSlots>,
    id: u64,
    evicted: Arc<Notify>,
    /// The principal whose share it holds; `None` until `hello`.
    holder: Option<Principal>,
}

/// Why an unauthenticated connection was closed to make room.
pub const EVICTED_MESSAGE: &str = "limit reached: connections_unauthenticated_max; this connection sent no hello and made room for a newer one (send hello right after connecting)";

impl Slot {
    /// Moves the slot into `p`'s share (at `hello`; again at a later `hello` as someone else).
    /// On a refusal the slot stays as it was.
    pub fn authenticate(&mut self, p: &Principal) -> Result<(), String> {
        if self
            .holder
            .as_ref()
            .is_some_and(|h| h.name == p.name && h.role == p.role)
        {
            return Ok(());
        }
        let mut s = self.slots.state.lock().expect("slots lock");
        // This connection is counted already (unauthenticated, or in its old share): the
        // check is whether it fits in `p`'s share, so it is counted as given back first.
        match &self.holder {
            None => {
                if !s.forget_unauthenticated(self.id) {
                    return Err(EVICTED_MESSAGE.into());
                }
                if let Err(e) = s.shares.take(p) {
                    // Still unauthenticated, and now the newest of them.
                    s.unauthenticated
                        .push_back((self.id, Arc::clone(&self.evicted)));
                    return Err(e);
                }
            }
            Some(old) => {
                let old = old.clone();
                s.shares.give_back(&old);
                if let Err(e) = s.shares.take(p) {
                    s.shares
                        .take(&old)
                        .expect("the old share was just given back");
                    return Err(e);
                }
            }
        }
        self.holder = Some(p.clone());
        Ok(())
    }

    pub fn is_authenticated(&self) -> bool {
        self.holder.is_some()
    }

    /// Completes when this connection, still unauthenticated, was evicted to make room.
    pub async fn evicted(&self) {
        self.evicted.notified().await;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut s = self.slots.state.lock().expect("slots lock");
        match &self.holder {
            None => {
                s.forget_unauthenticated(self.id);
            }
            Some(p) => s.shares.give_back(p),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(name: &str, role: Role) -> Principal {
        Principal {
            name: PrincipalName::new(name).unwrap(),
            role,
            groups: Vec::new(),
            part: Default::default(),
        }
    }

    #[test]
    fn a_principal_gets_its_share_and_operators_keep_their_reserve() {
        let opts = ShareOptions {
            max: 10,
            per_principal_max: 4,
            per_token_max: 10,
            operator_reserve: 2,
        };
        let mut s = Shares::new("waiters", opts);
        let (a, b, c) = (
            p("a", Role::Agent),
            p("b", Role::Agent),
            p("c", Role::Agent),
        );
        let admin = p("admin", Role::Operator);
        for _ in 0..4 {
            s.take(&a).unwrap();
        }
        let e = s.take(&a).unwrap_err();
        assert!(e.contains("waiters_per_principal_max = 4 for a"), "{e}");
        for _ in 0..4 {
            s.take(&b).unwrap();
        }
        // 8 of 10 held by agents: the last 2 are the operators'.
        let e = s.take(&c).unwrap_err();
        assert!(e.contains("reserved for operators"), "{e}");
        s.take(&admin).unwrap();
        s.take(&admin).unwrap();
        let e = s.take(&admin).unwrap_err();
        assert!(e.contains("waiters_max = 10"), "{e}");
        s.give_back(&a);
        assert_eq!(s.held_by(&a.name), 3);
        s.take(&c).unwrap();
        assert_eq!(s.total(), 10);
        for _ in 0..3 {
            s.give_back(&a);
        }
        assert_eq!(s.held_by(&a.name), 0);
        assert!(
            !s.of.contains_key(&a.name),
            "no entry is left for a principal at zero"
        );
    }

    /// Sandboxes of one token (`TOKEN/RUN`) each get a principal's share, and together the
    /// token's: past it, another sandbox of the same token is refused while another agent and
    /// the token's own principal's sibling pools are untouched.
    #[test]
    fn a_token_and_its_sandboxes_hold_one_share_together() {
        let opts = ShareOptions {
            max: 20,
            per_principal_max: 4,
            per_token_max: 6,
            operator_reserve: 2,
        };
        let mut s = Shares::new("subscriptions", opts);
        let (s1, s2, s3) = (
            p("mallory/r1", Role::Agent),
            p("mallory/r2", Role::Agent),
            p("mallory/r3", Role::Agent),
        );
        for _ in 0..4 {
            s.take(&s1).unwrap();
        }
        s.take(&s2).unwrap();
        s.take(&s2).unwrap();
        let e = s.take(&s3).unwrap_err();
        assert!(
            e.contains("subscriptions_per_token_max = 6 for the token mallory"),
            "{e}"
        );
        assert_eq!(s.try_take(&s2), Err(Full::Token(6)));
        assert_eq!(s.held_by_token(&s3.name), 6);
        // The token's own principal shares the same count.
        assert_eq!(s.try_take(&p("mallory", Role::Agent)), Err(Full::Token(6)));
        // Another agent still gets its share.
        for _ in 0..4 {
            s.take(&p("bob", Role::Agent)).unwrap();
        }
        // Giving back makes room for any sandbox of the token; at zero nothing is left.
        s.give_back(&s1);
        s.take(&s3).unwrap();
        for q in [&s1, &s1, &s1, &s2, &s2, &s3] {
            s.give_back(q);
        }
        assert_eq!(s.held_by_token(&s1.name), 0);
        assert!(!s.of_token.contains_key("mallory"));
    }

    /// Whether `slot` was told it is evicted.
    fn was_evicted(slot: &Slot) -> bool {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            tokio::time::timeout(std::time::Duration::from_millis(5), slot.evicted())
                .await
                .is_ok()
        })
    }

    #[test]
    fn unauthenticated_connections_and_agents_cannot_fill_the_operator_reserve() {
        let opts = ConnectionOptions {
            shares: ShareOptions {
                max: 12,
                per_principal_max: 5,
                per_token_max: 12,
                operator_reserve: 2,
            },
            unauthenticated_max: 3,
        };
        let slots = ConnectionSlots::new(opts);
        let mut held = Vec::new();
        // Agents may hold 12 - 2 - 3 = 7 together.
        for name in ["a", "a", "a", "a", "a", "b", "b"] {
            let mut s = slots.accept().unwrap();
            s.authenticate(&p(name, Role::Agent)).unwrap();
            held.push(s);
        }
        let mut s = slots.accept().unwrap();
        let e = s.authenticate(&p("a", Role::Agent)).unwrap_err();
        assert!(e.contains("per_principal"), "{e}");
        let e = s.authenticate(&p("c", Role::Agent)).unwrap_err();
        assert!(e.contains("reserved for operators"), "{e}");
        // The refused one is still unauthenticated; it becomes an operator's.
        s.authenticate(&p("admin", Role::Operator)).unwrap();
        held.push(s);
        // Three that never authenticate fill the unauthenticated pool; each newer one evicts
        // the oldest of them instead of being refused.
        let mut idle: Vec<Slot> = (0..3).map(|_| slots.accept().unwrap()).collect();
        assert!(!idle.iter().any(was_evicted));
        let mut newest = slots.accept().unwrap();
        assert!(was_evicted(&idle[0]) && !was_evicted(&idle[1]));
        let e = idle[0]
            .authenticate(&p("admin", Role::Operator))
            .unwrap_err();
        assert_eq!(e, EVICTED_MESSAGE);
        idle.remove(0);
        newest.authenticate(&p("admin", Role::Operator)).unwrap();
        held.push(newest);
        // 7 agents + 2 operators + 2 unauthenticated: one more fits, then the pool is full.
        let mut last = slots.accept().unwrap();
        last.authenticate(&p("admin", Role::Operator)).unwrap();
        held.push(last);
        assert_eq!(slots.open(), 12);
        assert!(slots.accept().unwrap_err().contains("connections_max = 12"));
        drop(idle);
        drop(held);
        assert_eq!(slots.open(), 0);
    }

    #[test]
    fn a_second_hello_moves_the_slot_or_leaves_it() {
        let slots = ConnectionSlots::new(ConnectionOptions {
            shares: ShareOptions {
                max: 4,
                per_principal_max: 1,
                per_token_max: 4,
                operator_reserve: 1,
            },
            unauthenticated_max: 1,
        });
        let mut one = slots.accept().unwrap();
        one.authenticate(&p("a", Role::Agent)).unwrap();
        let mut two = slots.accept().unwrap();
        two.authenticate(&p("b", Role::Agent)).unwrap();
        // `two` cannot become a second connection of `a`: it stays `b`'s.
        assert!(two.authenticate(&p("a", Role::Agent)).is_err());
        drop(one);
        two.authenticate(&p("a", Role::Agent)).unwrap();
        let mut three = slots.accept().unwrap();
        three.authenticate(&p("b", Role::Agent)).unwrap();
        drop((two, three));
        assert_eq!(slots.open(), 0);
    }
}
