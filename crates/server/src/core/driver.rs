//! The core's driver: the thread's loop that reads the core's queue and the clocks and hands
//! both to the shell (`Shell::handle(now, msg)`: the core decides, the shell executes), runs
//! the timer work when it is due, and commits each burst. Everything that waits or reads a
//! clock is here; the core takes time as an argument.

use super::*;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Messages of one burst handled with the same reading of the clocks (a burst of that many
/// takes well under a millisecond, the clocks' resolution for the core).
const CLOCK_EVERY: usize = 64;

/// The clocks now; monotonic time counts from `started`.
fn clocks(started: Instant) -> Now {
    Now {
        wall_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        mono_ms: started.elapsed().as_millis() as u64,
    }
}

/// What the driver runs: the core with the shell of one store (the embedded ledger's
/// `Shell`, PostgreSQL's `PgShell`).
pub(super) trait Executor {
    /// A burst of messages (or timer work) starts: the PostgreSQL store opens its transaction
    /// and catches up with other nodes; the ledger has nothing to do.
    fn begin(&mut self) {}
    fn handle(&mut self, now: Now, msg: CoreMsg) -> bool;
    fn fire_timers(&mut self, now: Now);
    fn commit(&mut self) -> Option<bool>;
    fn next_timeout(&mut self, now: Now) -> Option<Duration>;
    fn idle_spin(&self) -> Duration;
}

impl Executor for Shell {
    fn handle(&mut self, now: Now, msg: CoreMsg) -> bool {
        Shell::handle(self, now, msg)
    }
    fn fire_timers(&mut self, now: Now) {
        Shell::fire_timers(self, now)
    }
    fn commit(&mut self) -> Option<bool> {
        Shell::commit(self)
    }
    fn next_timeout(&mut self, now: Now) -> Option<Duration> {
        Shell::next_timeout(self, now)
    }
    fn idle_spin(&self) -> Duration {
        self.core().options().idle_spin
    }
}

impl Executor for PgShell {
    fn begin(&mut self) {
        PgShell::begin(self)
    }
    fn handle(&mut self, now: Now, msg: CoreMsg) -> bool {
        PgShell::handle(self, now, msg)
    }
    fn fire_timers(&mut self, now: Now) {
        PgShell::fire_timers(self, now)
    }
    fn commit(&mut self) -> Option<bool> {
        PgShell::commit(self)
    }
    fn next_timeout(&mut self, now: Now) -> Option<Duration> {
        PgShell::next_timeout(self, now)
    }
    fn idle_spin(&self) -> Duration {
        Duration::ZERO // Its commits never run "inline": nothing to spin for.
    }
}

impl Shell {
    /// Runs the core until shutdown. `rx` is the only way in.
    pub fn run(self, rx: mpsc::Receiver<CoreMsg>) {
        drive(self, rx)
    }
}

impl PgShell {
    /// Runs the core until shutdown. `rx` is the only way in.
    pub fn run(self, rx: mpsc::Receiver<CoreMsg>) {
        drive(self, rx)
    }
}

fn drive(mut ex: impl Executor, rx: mpsc::Receiver<CoreMsg>) {
    let started = Instant::now();
    let mut lone_synced = false;
    loop {
        // A client that sends one request at a time sends its next one within tens of µs
        // of its reply, which the core has just written itself (after an inline sync):
        // watching the queue that long spares the next request a wakeup of the core
        // (15–30 µs on a VM). Only then, so under load the core never burns CPU the IO
        // thread needs.
        let spin = if lone_synced {
            ex.idle_spin()
        } else {
            Duration::ZERO
        };
        let Some(msg) = next_message(&mut ex, &rx, spin, started) else {
            return; // Every sender is gone.
        };
        ex.begin();
        let mut handled = 0;
        if let Some(msg) = msg {
            handled += 1;
            // One reading of the clocks for a burst (re-read every `CLOCK_EVERY` messages):
            // two clock reads per message cost the core more than some messages do.
            let mut now = clocks(started);
            if ex.handle(now, msg) {
                return;
            }
            // Drain what else is queued before doing timer work: batching keeps the sync
            // thread's group commits large under load.
            while let Ok(msg) = rx.try_recv() {
                handled += 1;
                if handled % CLOCK_EVERY == 0 {
                    now = clocks(started);
                }
                if ex.handle(now, msg) {
                    return;
                }
            }
        }
        ex.fire_timers(clocks(started));
        let synced_here = ex.commit() == Some(true);
        lone_synced = synced_here && handled == 1;
    }
}

/// The next message, after watching the queue for up to `spin` first; `Some(None)` when a
/// timer is due first; `None` when every sender is gone.
fn next_message(
    ex: &mut impl Executor,
    rx: &mpsc::Receiver<CoreMsg>,
    spin: Duration,
    started: Instant,
) -> Option<Option<CoreMsg>> {
    if !spin.is_zero() {
        let until = Instant::now() + spin;
        loop {
            match rx.try_recv() {
                Ok(m) => return Some(Some(m)),
                Err(mpsc::TryRecvError::Disconnected) => return None,
                Err(mpsc::TryRecvError::Empty) if Instant::now() < until => {
                    std::hint::spin_loop();
                }
                Err(mpsc::TryRecvError::Empty) => break,
            }
        }
    }
    match ex.next_timeout(clocks(started)) {
        Some(t) => match rx.recv_timeout(t) {
            Ok(m) => Some(Some(m)),
            Err(mpsc::RecvTimeoutError::Timeout) => Some(None),
            Err(mpsc::RecvTimeoutError::Disconnected) => None,
        },
        None => rx.recv().ok().map(Some),
    }
}
