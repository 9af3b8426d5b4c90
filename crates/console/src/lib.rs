//! estop's operator console: an HTTP/JSON API over the operator verbs and reads of protocol v1
//! (through the same core messages, so the same semantics and durability), server-sent events,
//! Prometheus metrics and an embedded web UI. `estop serve` runs it as a service beside its
//! listeners (`Console` implements `estop_server::service::Service`). See docs/HTTP.md.

mod auth;
mod events;
mod gate;
mod http;
mod listen;
mod metrics;
mod ui;

use estop_server::service::{Service, ServiceContext, Started};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// The default console address: loopback only.
pub const DEFAULT_ADDR: &str = "127.0.0.1:7421";

#[derive(Debug, Clone)]
pub struct ConsoleOptions {
    /// Where to listen (`host:port`; port 0 picks a free one).
    pub addr: String,
    /// Whether failing to bind stops the daemon (an address the user asked for) or only
    /// disables the console with a warning (the default address, e.g. taken by another daemon).
    pub required: bool,
    /// A browser session lasts this long.
    pub session_ttl: Duration,
    /// A login link works once, within this long.
    pub login_link_ttl: Duration,
    /// Most console connections open at once.
    pub connections_max: usize,
    /// Most server-sent-event streams open at once.
    pub event_streams_max: usize,
}

impl Default for ConsoleOptions {
    fn default() -> Self {
        ConsoleOptions {
            addr: DEFAULT_ADDR.to_string(),
            required: false,
            session_ttl: Duration::from_secs(12 * 3600),
            login_link_ttl: Duration::from_secs(15 * 60),
            connections_max: 256,
            event_streams_max: 64,
        }
    }
}

/// The console service.
#[derive(Debug)]
pub struct Console {
    opts: ConsoleOptions,
}

impl Console {
    pub fn new(opts: ConsoleOptions) -> Console {
        Console { opts }
    }
}

/// The address a browser should use for `bound` (an unspecified bind address means loopback).
fn reachable(bound: SocketAddr) -> SocketAddr {
    if bound.ip().is_unspecified() {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), bound.port())
    } else {
        bound
    }
}

impl Service for Console {
    fn start(self: Box<Self>, ctx: ServiceContext) -> Result<Started, String> {
        let o = self.opts;
        let std_listener = match std::net::TcpListener::bind(&o.addr) {
            Ok(l) => l,
            Err(e) if !o.required => {
                estop_server::log::warn(&format!(
                    "console disabled: cannot listen on {}: {e} (pass --console ADDR, or --console off)",
                    o.addr
                ));
                return Ok(Started {
                    ready: vec![("console".into(), "-".into())],
                    notices: Vec::new(),
                    task: Box::pin(async {}),
                });
            }
            Err(e) => return Err(format!("cannot listen for the console on {}: {e}", o.addr)),
        };
        let bound = std_listener
            .local_addr()
            .map_err(|e| format!("console address: {e}"))?;
        std_listener
            .set_nonblocking(true)
            .map_err(|e| format!("console listener: {e}"))?;
        let listener = tokio::net::TcpListener::from_std(std_listener)
            .map_err(|e| format!("console listener: {e}"))?;
        if !bound.ip().is_loopback() {
            estop_server::log::warn(&format!(
                "the console listens on {bound}, beyond loopback, over plain HTTP: put it behind TLS you trust"
            ));
        }
        let url = format!("http://{}", reachable(bound));
        let app = Arc::new(http::App {
            shared: Arc::clone(&ctx.shared),
            auth: auth::Auth::new(o.session_ttl, o.login_link_ttl),
            streams: Arc::new(Semaphore::new(o.event_streams_max)),
            streams_max: o.event_streams_max,
            conns: Arc::new(Semaphore::new(o.connections_max)),
            conns_max: o.connections_max,
            base_url: url.clone(),
            cookie: format!("{}_{}", auth::COOKIE, bound.port()),
            ctx: ctx.clone(),
        });
        // A revoked token's console sessions and login links end with it, at once.
        let weak = Arc::downgrade(&app);
        ctx.shared.tokens.on_revoke(Box::new(move |name| {
            if let Some(app) = weak.upgrade() {
                app.auth.end_principal(name.as_str());
            }
        }));
        let mut notices = Vec::new();
        // The one-time login link is made for whoever DATA/operator.token names.
        let operator = std::fs::read_to_string(ctx.data.join("operator.token"))
            .ok()
            .and_then(|t| ctx.shared.tokens.authenticate(&t));
        match operator {
            Some(p) => {
                let (code, _) = app.auth.login_link(p);
                notices.push(format!(
                    "estop console {url}/login?code={code} (one-time login link, valid {} min; later, log in with a token)",
                    o.login_link_ttl.as_secs() / 60
                ));
            }
            None => notices.push(format!(
                "estop console {url} (no one-time link: DATA/operator.token is missing; log in with an operator token)"
            )),
        }
        let listener = listen::Bounded::new(listener, Arc::clone(&app.conns));
        let router = http::router(Arc::clone(&app));
        let task = async move {
            if let Err(e) = axum::serve(listener, router).await {
                estop_server::log::error(&format!("console stopped: {e}"));
            }
        };
        Ok(Started {
            ready: vec![("console".into(), bound.to_string())],
            notices,
            task: Box::pin(task),
        })
    }
}
