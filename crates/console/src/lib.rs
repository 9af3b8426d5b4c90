//! estop's operator console: an HTTP/JSON API over the operator verbs and reads of protocol v1
//! (through the same core messages, so the same semantics and durability), server-sent events,
//! Prometheus metrics and an embedded web UI. `estop serve` runs it as a service beside its
//! listeners (`Console` implements `estop_server::service::Service`). See docs/HTTP.md.

mod api;
mod app;
mod auth;
mod events;
mod http;
mod listen;
mod metrics;
mod quota;
mod trajectories;
mod ui;

use estop_server::service::{Service, ServiceContext, Started};
use std::io::{IsTerminal as _, Write as _};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The default console address: loopback only.
pub const DEFAULT_ADDR: &str = "127.0.0.1:7421";
/// The file in the data directory (mode 0600) that holds the one-time login link.
pub const LOGIN_FILE: &str = "console-login";

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
    /// Most console connections open at once (at the bound the longest-idle one is closed).
    pub connections_max: usize,
    /// A request head must arrive within this long of the connection being ready for one (also
    /// the idle timeout of a kept-alive connection).
    pub header_read_timeout: Duration,
    /// A request body must arrive within this long of its head.
    pub body_read_timeout: Duration,
    /// An answer the client does not read for this long ends its connection.
    pub write_stall_timeout: Duration,
    /// Most server-sent-event streams open at once.
    pub event_streams_max: usize,
    /// Most event streams one principal holds.
    pub event_streams_per_principal_max: usize,
    /// Event streams only operators may open.
    pub event_streams_operator_reserve: usize,
}

impl Default for ConsoleOptions {
    fn default() -> Self {
        ConsoleOptions {
            addr: DEFAULT_ADDR.to_string(),
            required: false,
            session_ttl: Duration::from_secs(12 * 3600),
            login_link_ttl: Duration::from_secs(15 * 60),
            connections_max: 256,
            header_read_timeout: Duration::from_millis(listen::HEADER_READ_MS),
            body_read_timeout: Duration::from_millis(listen::BODY_READ_MS),
            write_stall_timeout: Duration::from_millis(listen::WRITE_STALL_MS),
            event_streams_max: 64,
            event_streams_per_principal_max: 16,
            event_streams_operator_reserve: 16,
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
        let app = Arc::new(app::App {
            shared: Arc::clone(&ctx.shared),
            auth: auth::Auth::new(o.session_ttl, o.login_link_ttl),
            streams: quota::Counted::new(quota::ShareOptions {
                max: o.event_streams_max,
                per_principal_max: o.event_streams_per_principal_max,
                // Console callers are tokens' own principals (no sandbox logs in).
                per_token_max: o.event_streams_per_principal_max,
                operator_reserve: o.event_streams_operator_reserve,
            }),
            conns: listen::Conns::new(o.connections_max),
            base_url: url.clone(),
            trajectory_reads: trajectories::reads(),
            control_asks: trajectories::asks(),
            ctx: ctx.clone(),
        });
        // A revoked token's console sessions and login links end with it, at once.
        let weak = Arc::downgrade(&app);
        ctx.shared.tokens.on_revoke(Box::new(move |name| {
            if let Some(app) = weak.upgrade() {
                app.auth.end_principal(name.as_str());
            }
        }));
        let notices = vec![login_notice(&app, &ctx, &url, o.login_link_ttl)?];
        let router = http::router(Arc::clone(&app));
        let timeouts = listen::Timeouts {
            header_read: o.header_read_timeout,
            body_read: o.body_read_timeout,
            write_stall: o.write_stall_timeout,
        };
        let task = listen::serve(listener, router, Arc::clone(&app.conns), timeouts);
        Ok(Started {
            ready: vec![("console".into(), bound.to_string())],
            notices,
            task: Box::pin(task),
        })
    }
}

/// Makes the one-time login link for whoever DATA/operator.token names, writes it to
/// DATA/console-login (0600), and says where it is: the link itself is printed only to an
/// interactive terminal (stdout under a supervisor ends up in journald or `docker logs`).
fn login_notice(
    app: &app::App,
    ctx: &ServiceContext,
    url: &str,
    ttl: Duration,
) -> Result<String, String> {
    let operator = std::fs::read_to_string(ctx.data.join("operator.token"))
        .ok()
        .and_then(|t| ctx.shared.tokens.authenticate(&t).ok().flatten());
    let Some(p) = operator else {
        return Ok(format!(
            "estop console {url} (no one-time link: DATA/operator.token is missing; log in with an operator token)"
        ));
    };
    let (code, _) = app.auth.login_link(p);
    let link = format!("{url}/login#code={code}");
    let file = ctx.data.join(LOGIN_FILE);
    write_private(&file, &format!("{link}\n"))
        .map_err(|e| format!("cannot write the login link to {}: {e}", file.display()))?;
    let minutes = ttl.as_secs() / 60;
    Ok(if std::io::stdout().is_terminal() {
        format!(
            "estop console {link} (one-time login link, valid {minutes} min; later, log in with a token)"
        )
    } else {
        format!(
            "estop console {url} (one-time login link in {}, valid {minutes} min; later, log in with a token)",
            file.display()
        )
    })
}

/// Writes `text` to `path`, readable by the owner only (also when the file existed).
fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    f.write_all(text.as_bytes())?;
    f.sync_all()
}
