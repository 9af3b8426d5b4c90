//! A node of the PostgreSQL store (docs/STORES.md): the core's shell over the database, and
//! the listener that wakes the core when another node commits (LISTEN/NOTIFY, a poll as a
//! fallback). `serve` starts both; the database side is `pgstore`, the executor `core::PgShell`.

use crate::pgstore::{CHANNEL, SCHEMA_VERSION, StoreError, Target, open};
use crate::tokens::pg::TOKEN_CHANNEL;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// How often a node looks for other nodes' records without a notification (a fallback: a
/// notification lost with a connection is made up by a catch-up at every reconnect already).
const POLL: Duration = Duration::from_secs(5);
/// The listener's pause before it reconnects to a database that is down.
const RECONNECT_PAUSE: Duration = Duration::from_secs(1);

/// The core's shell over the database at `url`, with the listener that wakes it when other
/// nodes commit (a thread of its own, with its own connection).
pub fn shell(
    core_opts: &crate::core::CoreOptions,
    limits: &estop_kernel::Limits,
    url: &str,
    (durable_tx, core_tx): (
        &std::sync::Arc<tokio::sync::watch::Sender<crate::durable::DurableState>>,
        &std::sync::mpsc::Sender<crate::core::CoreMsg>,
    ),
    on_tokens: OnTokens,
) -> Result<crate::core::PgShell, StoreError> {
    use std::sync::Arc;
    let target = Target::parse(url)?;
    let mut node = [0u8; 8];
    getrandom::fill(&mut node)
        .map_err(|e| StoreError::Node(format!("no randomness for the node id: {e}")))?;
    let node: String = node.iter().map(|b| format!("{b:02x}")).collect();
    let wake = Arc::new(AtomicBool::new(false));
    // Snapshots go into the database (`estop_snapshot`) with a burst's commit, as often as
    // the ledger's (`--snapshot-every`).
    let core = core_opts.clone();
    let limits = limits.clone();
    let open_target = target.clone();
    let open: crate::core::PgOpenFn = Box::new(move || {
        // The gate is rebuilt over a plain connection; the bursts go over a pipelined one
        // (`pgconn`), whose first read starts after the last record loaded here.
        let (_, gate, last) = open(&open_target, &limits)?;
        let conn = crate::pgconn::BurstConn::connect(&open_target)?;
        crate::log::info(&format!(
            "store: PostgreSQL schema version {SCHEMA_VERSION}, gate rebuilt from {last} records"
        ));
        Ok((conn, gate, last))
    });
    let shell = crate::core::PgShell::new(
        core,
        Arc::clone(durable_tx),
        open,
        Arc::clone(&wake),
        node.clone(),
    )?;
    let core_tx = core_tx.clone();
    std::thread::Builder::new()
        .name("estop-pg-listen".into())
        .spawn(move || listen(&target, &node, (&wake, &core_tx), &on_tokens))
        .map_err(|e| StoreError::Node(format!("cannot start the listener: {e}")))?;
    Ok(shell)
}

/// Wakes the core to catch up, unless a wake-up is already queued; false once the core is gone.
fn poke(wake: &AtomicBool, core_tx: &std::sync::mpsc::Sender<crate::core::CoreMsg>) -> bool {
    if wake.swap(true, Ordering::SeqCst) {
        return true;
    }
    core_tx.send(crate::core::CoreMsg::CatchUp).is_ok()
}

/// What the listener calls when the token registry may have changed (`Tokens::refresh`).
pub type OnTokens = Box<dyn Fn() + Send>;

/// The listener: LISTENs on `CHANNEL` and wakes the core for every other node's commit, and
/// on `TOKEN_CHANNEL` and refreshes the node's tokens for every change of the registry; does
/// both every `POLL` in any case (and at every reconnect: notifications are lost with a
/// connection); reconnects while the database is down.
fn listen(
    target: &Target,
    node: &str,
    (wake, core_tx): (&AtomicBool, &std::sync::mpsc::Sender<crate::core::CoreMsg>),
    on_tokens: &OnTokens,
) {
    use postgres::fallible_iterator::FallibleIterator;
    let own = format!("{node} ");
    loop {
        if let Ok(mut client) = target.connect()
            && client
                .batch_execute(&format!("LISTEN {CHANNEL}; LISTEN {TOKEN_CHANNEL}"))
                .is_ok()
        {
            // What was committed while this node was not listening.
            on_tokens();
            if !poke(wake, core_tx) {
                return;
            }
            loop {
                let next = client.notifications().timeout_iter(POLL).next();
                let woke = match next {
                    Ok(Some(n)) if n.channel() == TOKEN_CHANNEL => {
                        on_tokens();
                        true
                    }
                    Ok(Some(n)) if n.payload().starts_with(&own) => true,
                    Ok(Some(_)) => poke(wake, core_tx),
                    Ok(None) => {
                        on_tokens();
                        poke(wake, core_tx)
                    }
                    Err(_) => break, // The connection is gone: reconnect.
                };
                if !woke {
                    return;
                }
            }
        }
        std::thread::sleep(RECONNECT_PAUSE);
    }
}
