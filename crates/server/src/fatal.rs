//! A panic on a thread the gate cannot run without ends the process (SPEC §6): left alive, a
//! daemon whose core is gone answers `unavailable` forever, and one whose sync thread is gone
//! never acknowledges anything again. Exiting non-zero lets a supervisor restart it, and
//! recovery replays the ledger: nothing acknowledged is lost, nothing unacknowledged was seen.

/// The name of the core's thread (the state's single owner).
pub const CORE_THREAD_NAME: &str = "estop-core";

/// The threads whose panic is fatal: the state's owner and the ledger's sync thread.
pub const FATAL_THREADS: &[&str] = &[CORE_THREAD_NAME, estop_ledger::SYNC_THREAD_NAME];

/// The exit status after a fatal panic (`EX_SOFTWARE`).
pub const FATAL_EXIT_CODE: i32 = 70;

/// Installs the panic hook: the default report first, then, on a thread of [`FATAL_THREADS`],
/// a line saying what happened and what follows, and the exit. Panics elsewhere (one
/// connection's task) stay with that connection.
pub fn install_panic_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        let thread = std::thread::current();
        let Some(name) = thread.name().filter(|n| FATAL_THREADS.contains(n)) else {
            return;
        };
        crate::log::error(&format!(
            "fatal: the {name} thread panicked ({info}); estop serve exits with status {FATAL_EXIT_CODE} rather than run half alive. Restart it (a supervisor should): recovery replays the ledger, and nothing acknowledged is lost"
        ));
        std::process::exit(FATAL_EXIT_CODE);
    }));
}
