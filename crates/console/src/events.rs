//! Server-sent events: the gate-wide feed of changes (`CoreMsg::Feed`), each event shown only
//! once the change it reports is durable (G6). Agents see their own runs only (the core
//! filters). A stream that falls behind is ended by the core; the console's page reconnects
//! and re-reads the state. A stream of a browser session ends when the session does. Streams
//! are shared out per principal, with a reserve for operators (`quota`).

use crate::app::{AppState, Caller, error};
use crate::quota::{Full, Slot};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use estop_protocol::ErrorCode;
use estop_server::core::CoreMsg;
use estop_server::durable::{self, Durability};
use estop_server::observe::{FEED_QUEUE_MAX, FeedEvent, FeedRx};
use serde_json::json;
use std::convert::Infallible;
use std::time::Duration;

/// How often a stream checks that its session is still alive (and sends a comment line).
const CHECK_EVERY: Duration = Duration::from_secs(15);

fn data(e: &FeedEvent) -> String {
    json!({
        "event": e.event,
        "run": e.run,
        "key": e.key,
        "detail": e.detail,
        "at": e.at,
    })
    .to_string()
}

struct Stream {
    app: AppState,
    caller: Caller,
    run: Option<String>,
    rx: FeedRx,
    _slot: Slot,
    /// Moves on every token revocation: the stream ends at once if it was this caller's.
    revocations: tokio::sync::watch::Receiver<u64>,
    first: bool,
}

/// Whether the stream may go on: its session (if it has one) is live and its token not revoked.
fn alive(s: &Stream) -> bool {
    let session_live = s
        .caller
        .session
        .as_ref()
        .is_none_or(|id| s.app.auth.session(id).is_some());
    session_live && s.app.shared.tokens.is_current(&s.caller.principal)
}

pub async fn stream(app: AppState, caller: Caller, run: Option<String>) -> Response {
    let slot = match app.streams.take(&caller.principal) {
        Ok(s) => s,
        Err(full) => {
            let what = match full {
                Full::Principal(n) | Full::Token(n) => {
                    format!("{n} event streams for {}", caller.principal.name)
                }
                Full::Others(n) => {
                    format!("{n} event streams held by agents (the rest are kept for operators)")
                }
                Full::Total(n) => format!("event streams = {n}"),
            };
            return error(
                ErrorCode::LimitExceeded,
                format!("limit reached: {what}; close other streams or console tabs"),
            );
        }
    };
    let (tx, rx) = tokio::sync::mpsc::channel(FEED_QUEUE_MAX);
    let msg = CoreMsg::Feed {
        principal: caller.principal.clone(),
        tx,
    };
    if app.shared.core_tx.send(msg).is_err() {
        return error(ErrorCode::Unavailable, "the gate is shutting down");
    }
    let revocations = app.shared.tokens.revocations();
    let state = Stream {
        app,
        caller,
        run,
        rx,
        _slot: slot,
        revocations,
        first: true,
    };
    let events = futures_util::stream::unfold(state, |mut s| async move {
        if s.first {
            // Tells the client the feed is live: re-read the state now, then follow the events.
            s.first = false;
            let hello = Event::default().event("ready").data("{}");
            return Some((Ok::<_, Infallible>(hello), s));
        }
        loop {
            let next = tokio::select! {
                next = tokio::time::timeout(CHECK_EVERY, s.rx.recv()) => next,
                Ok(()) = s.revocations.changed() => {
                    if !alive(&s) {
                        return None;
                    }
                    continue;
                }
            };
            match next {
                Ok(Some(e)) => {
                    if s.run.as_ref().is_some_and(|r| *r != e.run) {
                        continue;
                    }
                    let mut durable_rx = s.app.shared.durable_rx.clone();
                    if durable::wait(&mut durable_rx, e.after).await != Durability::Durable {
                        continue;
                    }
                    let ev = Event::default().data(data(&e));
                    return Some((Ok(ev), s));
                }
                // The core dropped the feed (behind, or shutting down): end; the client
                // reconnects and re-reads.
                Ok(None) => return None,
                Err(_) => {
                    if !alive(&s) {
                        return None;
                    }
                    return Some((Ok(Event::default().comment("alive")), s));
                }
            }
        }
    });
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(CHECK_EVERY))
        .into_response()
}
