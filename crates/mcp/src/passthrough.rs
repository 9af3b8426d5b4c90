//! Resources, resource templates, subscriptions, prompts and completions of the upstreams,
//! passed through ungated: they are reads the client's application asks for, not the model's
//! tool calls. Prompts are renamed `server__prompt` like tools; resource URIs and templates are
//! kept and routed back to the upstream that listed them.

use crate::config::SEPARATOR;
use crate::upstream::Upstream;
use rmcp::model::{
    CompleteRequestParams, CompleteResult, GetPromptRequestParams, GetPromptResponse, Prompt,
    ReadResourceRequestParams, ReadResourceResponse, Reference, Resource, ResourceTemplate,
    SubscribeRequestParams, UnsubscribeRequestParams,
};
use rmcp::service::RoleServer;
use rmcp::{ErrorData as McpError, Peer};
use std::collections::BTreeMap;
use std::sync::Mutex;

/// Most (URI, session) subscriptions the gateway keeps at once; one more is refused.
pub const SUBSCRIPTIONS_MAX: usize = 1024;

type Offer = fn(&rmcp::model::ServerCapabilities) -> bool;

/// Whether `up` said (in its `initialize` answer) that it offers what `offer` looks for.
pub fn has(up: &Upstream, offer: Offer) -> bool {
    up.info().is_some_and(|i| offer(&i.capabilities))
}

pub fn subscribable(c: &rmcp::model::ServerCapabilities) -> bool {
    c.resources.as_ref().and_then(|r| r.subscribe) == Some(true)
}

/// What any upstream offers, so the front advertises it (and nothing it cannot pass on).
#[derive(Debug, Clone, Copy, Default)]
pub struct Offers {
    pub resources: bool,
    pub subscribe: bool,
    pub prompts: bool,
    pub completions: bool,
}

pub fn offers(upstreams: &[Upstream]) -> Offers {
    let any = |offer: Offer| upstreams.iter().any(|u| has(u, offer));
    Offers {
        resources: any(|c| c.resources.is_some()),
        subscribe: any(subscribable),
        prompts: any(|c| c.prompts.is_some()),
        completions: any(|c| c.completions.is_some()),
    }
}

/// Where resource requests go, kept between requests: the upstream of each listed URI and
/// template, and which client sessions subscribed to which URI.
#[derive(Debug, Default)]
pub struct Routes {
    uris: Mutex<BTreeMap<String, usize>>,
    /// Each listed template (`uriTemplate`) and its upstream, in the upstreams' order.
    templates: Mutex<Vec<(String, usize)>>,
    /// URI → subscriber id (a session's, or a 2026-07-28 listen stream's) → where to tell it.
    subs: Mutex<BTreeMap<String, BTreeMap<u64, Subscriber>>>,
}

/// Who hears of a subscribed URI's updates.
#[derive(Debug, Clone)]
pub enum Subscriber {
    /// A session's `resources/subscribe` (clients before 2026-07-28).
    Session(Peer<RoleServer>),
    /// A `subscriptions/listen` stream (2026-07-28), removed when the stream ends.
    Listen(rmcp::service::SubscriptionSink),
}

impl Subscriber {
    fn gone(&self) -> bool {
        match self {
            Subscriber::Session(p) => p.is_transport_closed(),
            Subscriber::Listen(_) => false,
        }
    }

    async fn updated(&self, uri: &str) {
        let _ = match self {
            Subscriber::Session(p) => {
                let note = rmcp::model::ResourceUpdatedNotificationParam::new(uri);
                p.notify_resource_updated(note).await.map_err(|_| ())
            }
            Subscriber::Listen(sink) => sink.notify_resource_updated(uri).await.map_err(|_| ()),
        };
    }
}

/// The upstream whose template a URI expands: the template with the longest literal start
/// (before its first `{`) that the URI begins with, the first declared on a tie. A URI template
/// with no literal start routes nothing (it would claim every URI).
pub fn template_route(templates: &[(String, usize)], uri: &str) -> Option<usize> {
    let mut best: Option<(usize, usize)> = None;
    for (template, up) in templates {
        let prefix = template.split('{').next().unwrap_or_default();
        if prefix.is_empty() || !uri.starts_with(prefix) {
            continue;
        }
        if best.is_none_or(|(len, _)| prefix.len() > len) {
            best = Some((prefix.len(), *up));
        }
    }
    best.map(|(_, up)| up)
}

impl Routes {
    /// The upstream of a URI already listed or matching a listed template (no listing).
    pub fn known(&self, uri: &str) -> Option<usize> {
        if let Some(up) = self.uris.lock().expect("not poisoned").get(uri) {
            return Some(*up);
        }
        template_route(&self.templates.lock().expect("not poisoned"), uri)
    }

    /// The upstream a resource URI belongs to: a listed one, else one whose template it
    /// expands; not known yet, the upstreams are listed again first.
    pub async fn route(&self, upstreams: &[Upstream], uri: &str) -> Result<usize, McpError> {
        if let Some(up) = self.known(uri) {
            return Ok(up);
        }
        resources(upstreams, self).await?;
        templates(upstreams, self).await?;
        self.known(uri)
            .ok_or_else(|| McpError::resource_not_found(format!("no resource {uri:?}"), None))
    }
}

fn failed(up: &Upstream, e: impl std::fmt::Display) -> McpError {
    McpError::internal_error(format!("upstream {:?}: {e}", up.name), None)
}

/// Every upstream's resources; which upstream each URI came from is kept in `routes`.
pub async fn resources(upstreams: &[Upstream], routes: &Routes) -> Result<Vec<Resource>, McpError> {
    let mut all = Vec::new();
    let mut uris = BTreeMap::new();
    for (i, up) in upstreams.iter().enumerate() {
        if !has(up, |c| c.resources.is_some()) {
            continue;
        }
        for r in up
            .peer()
            .await
            .map_err(|e| failed(up, e))?
            .list_all_resources()
            .await
            .map_err(|e| failed(up, e))?
        {
            // Two upstreams listing one URI: the first declared keeps it.
            uris.entry(r.uri.clone()).or_insert(i);
            all.push(r);
        }
    }
    *routes.uris.lock().expect("not poisoned") = uris;
    Ok(all)
}

/// Every upstream's resource templates; which upstream each came from is kept in `routes`.
pub async fn templates(
    upstreams: &[Upstream],
    routes: &Routes,
) -> Result<Vec<ResourceTemplate>, McpError> {
    let mut all = Vec::new();
    let mut kept = Vec::new();
    for (i, up) in upstreams.iter().enumerate() {
        if !has(up, |c| c.resources.is_some()) {
            continue;
        }
        for t in up
            .peer()
            .await
            .map_err(|e| failed(up, e))?
            .list_all_resource_templates()
            .await
            .map_err(|e| failed(up, e))?
        {
            kept.push((t.uri_template.clone(), i));
            all.push(t);
        }
    }
    *routes.templates.lock().expect("not poisoned") = kept;
    Ok(all)
}

pub async fn read(
    upstreams: &[Upstream],
    route: usize,
    params: ReadResourceRequestParams,
) -> Result<ReadResourceResponse, McpError> {
    let up = &upstreams[route];
    up.peer()
        .await
        .map_err(|e| failed(up, e))?
        .read_resource_once(params)
        .await
        .map_err(|e| failed(up, e))
}

/// Every upstream's prompts, named `server__prompt`.
pub async fn prompts(upstreams: &[Upstream]) -> Result<Vec<Prompt>, McpError> {
    let mut all = Vec::new();
    for up in upstreams {
        if !has(up, |c| c.prompts.is_some()) {
            continue;
        }
        for mut p in up
            .peer()
            .await
            .map_err(|e| failed(up, e))?
            .list_all_prompts()
            .await
            .map_err(|e| failed(up, e))?
        {
            p.name = format!("{}{SEPARATOR}{}", up.name, p.name);
            all.push(p);
        }
    }
    Ok(all)
}

/// The upstream of a prompt named `server__prompt`, and the prompt's own name there.
fn prompt_route<'a>(
    upstreams: &'a [Upstream],
    name: &str,
) -> Result<(&'a Upstream, String), McpError> {
    let unknown = || McpError::invalid_params(format!("no prompt {name:?}"), None);
    let (server, own) = name.split_once(SEPARATOR).ok_or_else(unknown)?;
    let up = upstreams
        .iter()
        .find(|u| u.name == server)
        .ok_or_else(unknown)?;
    Ok((up, own.to_string()))
}

pub async fn get_prompt(
    upstreams: &[Upstream],
    mut params: GetPromptRequestParams,
) -> Result<GetPromptResponse, McpError> {
    let (up, name) = prompt_route(upstreams, &params.name)?;
    params.name = name;
    up.peer()
        .await
        .map_err(|e| failed(up, e))?
        .get_prompt_once(params)
        .await
        .map_err(|e| failed(up, e))
}

/// `completion/complete`, sent to the upstream of the prompt (`server__prompt`, renamed back)
/// or of the resource template it is about.
pub async fn complete(
    upstreams: &[Upstream],
    routes: &Routes,
    mut params: CompleteRequestParams,
) -> Result<CompleteResult, McpError> {
    let up = match &mut params.r#ref {
        Reference::Prompt(p) => {
            let (up, name) = prompt_route(upstreams, &p.name)?;
            p.name = name;
            up
        }
        Reference::Resource(r) => &upstreams[routes.route(upstreams, &r.uri).await?],
        _ => {
            return Err(McpError::invalid_params(
                "a completion reference of a kind the gateway cannot route",
                None,
            ));
        }
    };
    up.peer()
        .await
        .map_err(|e| failed(up, e))?
        .complete(params)
        .await
        .map_err(|e| failed(up, e))
}

/// `resources/subscribe` of one client session: the upstream of the URI is subscribed once,
/// by the first session; its `notifications/resources/updated` then reach every session
/// subscribed ([`updated`]).
#[allow(deprecated)] // resources/subscribe is what clients before 2026-07-28 send
pub async fn subscribe(
    upstreams: &[Upstream],
    routes: &Routes,
    session: u64,
    peer: Subscriber,
    params: SubscribeRequestParams,
) -> Result<(), McpError> {
    let up = &upstreams[routes.route(upstreams, &params.uri).await?];
    if !has(up, subscribable) {
        return Err(McpError::invalid_params(
            format!(
                "upstream {:?} does not offer resource subscriptions",
                up.name
            ),
            None,
        ));
    }
    let first = {
        let mut subs = routes.subs.lock().expect("not poisoned");
        let held: usize = subs.values().map(BTreeMap::len).sum();
        let again = subs
            .get(&params.uri)
            .is_some_and(|s| s.contains_key(&session));
        if !again && held >= SUBSCRIPTIONS_MAX {
            return Err(McpError::invalid_request(
                format!("the gateway holds {SUBSCRIPTIONS_MAX} subscriptions already"),
                None,
            ));
        }
        let sessions = subs.entry(params.uri.clone()).or_default();
        // The upstream hears only of a URI's first subscriber (a repeat is not a new one).
        let first = sessions.is_empty();
        sessions.insert(session, peer);
        first
    };
    if !first {
        return Ok(());
    }
    let uri = params.uri.clone();
    let sent = match up.peer().await {
        Ok(p) => p.subscribe(params).await.map_err(|e| failed(up, e)),
        Err(e) => Err(failed(up, e)),
    };
    if sent.is_err() {
        forget(routes, &uri, session);
    }
    sent
}

/// Drops one session's subscription; returns whether nobody is subscribed to `uri` any more.
pub fn forget(routes: &Routes, uri: &str, session: u64) -> bool {
    let mut subs = routes.subs.lock().expect("not poisoned");
    let Some(sessions) = subs.get_mut(uri) else {
        return false;
    };
    let had = sessions.remove(&session).is_some();
    let empty = sessions.is_empty();
    if empty {
        subs.remove(uri);
    }
    had && empty
}

/// `resources/unsubscribe` of one client session: the upstream is unsubscribed when the last
/// session goes. Unsubscribing what was not subscribed is not an error (it is already so).
#[allow(deprecated)]
pub async fn unsubscribe(
    upstreams: &[Upstream],
    routes: &Routes,
    session: u64,
    params: UnsubscribeRequestParams,
) -> Result<(), McpError> {
    if !forget(routes, &params.uri, session) {
        return Ok(());
    }
    let up = &upstreams[routes.route(upstreams, &params.uri).await?];
    up.peer()
        .await
        .map_err(|e| failed(up, e))?
        .unsubscribe(params)
        .await
        .map_err(|e| failed(up, e))
}

/// An upstream's `notifications/resources/updated`: passed to every live session subscribed to
/// the URI, if the URI is that upstream's (another upstream's word about it is dropped).
pub async fn updated(upstreams: &[Upstream], routes: &Routes, from: usize, uri: &str) {
    if routes.known(uri) != Some(from) {
        return;
    }
    let peers: Vec<_> = {
        let mut subs = routes.subs.lock().expect("not poisoned");
        let Some(sessions) = subs.get_mut(uri) else {
            return;
        };
        sessions.retain(|_, p| !p.gone());
        sessions.values().cloned().collect()
    };
    if peers.is_empty() {
        // Every subscriber is gone: stop the upstream's notifications too.
        routes.subs.lock().expect("not poisoned").remove(uri);
        let params = UnsubscribeRequestParams::new(uri);
        let _ = unsubscribe_upstream(&upstreams[from], params).await;
        return;
    }
    for p in peers {
        p.updated(uri).await;
    }
}

#[allow(deprecated)]
pub async fn unsubscribe_upstream(
    up: &Upstream,
    params: UnsubscribeRequestParams,
) -> Result<(), String> {
    let peer = up.peer().await?;
    peer.unsubscribe(params).await.map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::template_route;

    #[test]
    fn a_uri_goes_to_the_template_with_the_longest_literal_start() {
        let t = |s: &str, up| (s.to_string(), up);
        let templates = [
            t("file:///{path}", 0),
            t("file:///srv/{name}", 1),
            t("{scheme}://anything", 2),
            t("file:///srv/{other}", 3),
        ];
        assert_eq!(template_route(&templates, "file:///etc/hosts"), Some(0));
        assert_eq!(template_route(&templates, "file:///srv/a"), Some(1));
        assert_eq!(template_route(&templates, "https://anything"), None);
        assert_eq!(template_route(&templates, "notes://x"), None);
    }
}
