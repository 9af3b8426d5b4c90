//! The gateway's streamable HTTP front (`estop mcp --listen`): rmcp's `StreamableHttpService`
//! behind a door of estop's own. Every request must carry an estop **agent token**
//! (`Authorization: Bearer …`), which the daemon checks (each distinct token is its own gate
//! connection, so a revoked token stops working at once); a session is its principal's alone
//! (another principal naming its id finds nothing); bodies, sessions and principals are
//! bounded; a supplied `Mcp-Method` must name the body's method. rmcp checks `Host` and
//! `Origin` (DNS rebinding), the protocol-version header and, from 2026-07-28, the
//! `Mcp-Method` / `Mcp-Name` headers against the body.

use crate::config;
use crate::gateway::{Gateway, Shared};
use crate::principal::{Principal, Refused};
use crate::sep1686;
use anyhow::Result;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited, combinators::BoxBody};
use hyper::body::{Bytes, Incoming};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

type Body = BoxBody<Bytes, Infallible>;

pub struct Front {
    rmcp: StreamableHttpService<Gateway, LocalSessionManager>,
    sessions: Arc<LocalSessionManager>,
    /// Whose each open session is (by the daemon's principal name).
    owners: Mutex<BTreeMap<String, String>>,
    /// The principals met so far, by the SHA-256 of their token (the token is not kept).
    principals: tokio::sync::Mutex<BTreeMap<[u8; 32], Arc<Principal>>>,
    /// Held while a session is opened, so two at once cannot both take the last place.
    opening: tokio::sync::Mutex<()>,
    socket: String,
    http: config::Http,
    shared: Arc<Shared>,
}

impl Front {
    pub fn new(shared: Arc<Shared>, config: &config::Config, opts: &crate::Options) -> Front {
        let http = config.http.clone();
        let mut sessions = LocalSessionManager::default();
        sessions.session_config.keep_alive =
            Some(std::time::Duration::from_millis(http.session_idle_ms));
        let sessions = Arc::new(sessions);
        let (run, parent) = (opts.run.clone(), opts.parent.clone());
        let handlers = shared.clone();
        let rmcp_config = StreamableHttpServerConfig::default()
            .with_allowed_hosts(http.allowed_hosts.clone())
            .with_allowed_origins(http.allowed_origins.clone())
            .enforce_origin_validation()
            .with_max_request_body_bytes(http.body_bytes_max);
        let rmcp = StreamableHttpService::new(
            // One handler per session (and per request of a session-less revision); cheap:
            // the upstreams, tools and pins are shared, the caller comes with each request.
            move || {
                Ok(Gateway::new(
                    handlers.clone(),
                    None,
                    run.clone(),
                    parent.clone(),
                ))
            },
            sessions.clone(),
            rmcp_config,
        );
        Front {
            rmcp,
            sessions,
            owners: Mutex::new(BTreeMap::new()),
            principals: tokio::sync::Mutex::new(BTreeMap::new()),
            opening: tokio::sync::Mutex::new(()),
            socket: opts.socket(),
            http,
            shared,
        }
    }
}

/// Accepts connections on `listener` and serves each with HTTP/1.1 until the process stops.
pub async fn serve(front: Front, listener: tokio::net::TcpListener) -> Result<()> {
    let front = Arc::new(front);
    loop {
        let (stream, _) = listener.accept().await?;
        let front = front.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let front = front.clone();
                async move { Ok::<_, Infallible>(front.handle(req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}

fn plain(status: StatusCode, text: impl Into<String>) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, "text/plain; charset=utf-8")
        .body(Full::new(Bytes::from(text.into())).boxed())
        .expect("a valid response")
}

fn unauthorized(why: &str) -> Response<Body> {
    let mut r = plain(StatusCode::UNAUTHORIZED, why);
    r.headers_mut().insert(
        http::header::WWW_AUTHENTICATE,
        http::HeaderValue::from_static("Bearer"),
    );
    r
}

/// What rmcp answers for a session it does not know: a session of another principal reads
/// exactly the same, so its existence is not told either.
fn no_session() -> Response<Body> {
    plain(StatusCode::NOT_FOUND, "Not Found: Session not found")
}

impl Front {
    async fn handle(&self, req: Request<Incoming>) -> Response<Body> {
        let principal = match self.authenticate(req.headers()).await {
            Ok(p) => p,
            Err(response) => return response,
        };
        let (mut parts, body) = req.into_parts();
        let bytes = match Limited::new(body, self.http.body_bytes_max).collect().await {
            Ok(b) => b.to_bytes(),
            Err(_) => {
                return plain(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!(
                        "the body is over body_bytes_max ({} bytes)",
                        self.http.body_bytes_max
                    ),
                );
            }
        };
        let method = serde_json::from_slice::<serde_json::Value>(&bytes)
            .ok()
            .and_then(|v| v["method"].as_str().map(str::to_string));
        if let Some(r) = method_header_mismatch(&parts.headers, method.as_deref()) {
            return r;
        }
        let session = parts
            .headers
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        if let Some(id) = &session {
            let owner = self.owners.lock().expect("not poisoned").get(id).cloned();
            if owner.as_deref() != Some(principal.name.as_str()) {
                return no_session();
            }
        }
        parts.extensions.insert(principal.clone());
        // 2025-11-25's own task form is carried at this edge (rmcp cannot parse it).
        let bytes = match sep1686::inbound(&bytes, &|id| self.shared.is_1686(id)) {
            Some(rewritten) => Bytes::from(rewritten),
            None => bytes,
        };
        let req = Request::from_parts(parts, Full::new(bytes));
        let opens = session.is_none() && method.as_deref() == Some("initialize");
        let is_delete = req.method() == http::Method::DELETE;
        let response = if opens {
            let _one = self.opening.lock().await;
            if let Some(full) = self.full().await {
                return full;
            }
            self.rmcp.handle(req).await
        } else {
            self.rmcp.handle(req).await
        };
        if let Some(id) = response
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
        {
            let mut owners = self.owners.lock().expect("not poisoned");
            owners.insert(id.to_string(), principal.name.clone());
        }
        if is_delete && response.status().is_success() {
            let mut owners = self.owners.lock().expect("not poisoned");
            owners.remove(session.as_deref().unwrap_or_default());
            // rmcp answers 202; a session's end is 200 or 204 (the session is gone now, not
            // accepted for later): 204, no body.
            return Response::builder()
                .status(StatusCode::NO_CONTENT)
                .body(Full::new(Bytes::new()).boxed())
                .expect("a valid response");
        }
        if matches!(method.as_deref(), Some("initialize" | "tools/list")) {
            // What rmcp cannot say for 2025-11-25's task form: the capability, the tools' support.
            return response.map(|body| {
                body.map_frame(|frame| {
                    frame.map_data(|data| match sep1686::outbound_frame(&data) {
                        Some(out) => Bytes::from(out),
                        None => data,
                    })
                })
                .boxed()
            });
        }
        response
    }

    /// A refusal when `sessions_max` sessions are open (forgetting the owners of closed ones).
    async fn full(&self) -> Option<Response<Body>> {
        let open = self.sessions.sessions.read().await;
        self.owners
            .lock()
            .expect("not poisoned")
            .retain(|id, _| open.contains_key(&Arc::<str>::from(id.as_str())));
        (open.len() >= self.http.sessions_max).then(|| {
            plain(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "sessions_max ({}) sessions are open: close one (DELETE) or wait until one \
                     idles out",
                    self.http.sessions_max
                ),
            )
        })
    }

    /// The request's principal: its bearer token, as the daemon knows it.
    async fn authenticate(
        &self,
        headers: &http::HeaderMap,
    ) -> Result<Arc<Principal>, Response<Body>> {
        let token = headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                unauthorized(
                    "an estop agent token is needed: `Authorization: Bearer <token>` \
                     (`estop token create NAME --role agent`)",
                )
            })?;
        let hash: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let mut known = self.principals.lock().await;
        if let Some(p) = known.get(&hash)
            && p.is_live()
        {
            return Ok(p.clone());
        }
        known.retain(|_, p| p.is_live());
        if known.len() >= self.http.principals_max {
            return Err(plain(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "principals_max ({}) distinct tokens are in use on this gateway",
                    self.http.principals_max
                ),
            ));
        }
        match Principal::connect(&self.socket, token).await {
            Ok(p) => {
                known.insert(hash, p.clone());
                Ok(p)
            }
            Err(e @ Refused::Token(_)) => Err(unauthorized(&e.to_string())),
            Err(e @ Refused::Role(_)) => Err(plain(StatusCode::FORBIDDEN, e.to_string())),
            Err(e @ Refused::Unreachable(_)) => {
                Err(plain(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))
            }
        }
    }
}

/// A supplied `Mcp-Method` header must name the body's method, whatever the revision (rmcp
/// checks it, with `Mcp-Name`, from 2026-07-28 on): something routing on the header must never
/// see one call while the gateway runs another.
fn method_header_mismatch(headers: &http::HeaderMap, body: Option<&str>) -> Option<Response<Body>> {
    let mut said = headers.get_all("mcp-method").iter();
    let first = said.next()?;
    let why = match (first.to_str(), said.next(), body) {
        (_, Some(_), _) => "more than one Mcp-Method header".to_string(),
        (Ok(h), None, Some(b)) if h == b => return None,
        (Ok(h), None, Some(b)) => {
            format!("Mcp-Method header `{h}` does not match body method `{b}`")
        }
        (Ok(h), None, None) => format!("Mcp-Method header `{h}` but the body names no method"),
        (Err(_), None, _) => "the Mcp-Method header is not text".to_string(),
    };
    Some(plain(
        StatusCode::BAD_REQUEST,
        format!("Bad Request: {why}"),
    ))
}
