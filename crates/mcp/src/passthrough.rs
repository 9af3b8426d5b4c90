//! Resources and prompts of the upstreams, passed through ungated: they are reads the client's
//! application asks for, not the model's tool calls. Prompts are renamed `server__prompt` like
//! tools; resource URIs are kept and routed back to the upstream that listed them.

use crate::config::SEPARATOR;
use crate::upstream::Upstream;
use rmcp::ErrorData as McpError;
use rmcp::model::{
    GetPromptRequestParams, GetPromptResponse, Prompt, ReadResourceRequestParams,
    ReadResourceResponse, Resource,
};
use std::collections::BTreeMap;

type Offer = fn(&rmcp::model::ServerCapabilities) -> bool;

/// Whether `up` said (in its `initialize` answer) that it offers what `offer` looks for.
fn has(up: &Upstream, offer: Offer) -> bool {
    up.info().is_some_and(|i| offer(&i.capabilities))
}

/// Whether any upstream offers resources, prompts.
pub fn offers(upstreams: &[Upstream]) -> (bool, bool) {
    let any = |offer: Offer| upstreams.iter().any(|u| has(u, offer));
    (any(|c| c.resources.is_some()), any(|c| c.prompts.is_some()))
}

fn failed(up: &Upstream, e: impl std::fmt::Display) -> McpError {
    McpError::internal_error(format!("upstream {:?}: {e}", up.name), None)
}

/// Every upstream's resources, and which upstream each URI came from.
pub async fn resources(
    upstreams: &[Upstream],
) -> Result<(Vec<Resource>, BTreeMap<String, usize>), McpError> {
    let mut all = Vec::new();
    let mut routes = BTreeMap::new();
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
            routes.entry(r.uri.clone()).or_insert(i);
            all.push(r);
        }
    }
    Ok((all, routes))
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

pub async fn get_prompt(
    upstreams: &[Upstream],
    mut params: GetPromptRequestParams,
) -> Result<GetPromptResponse, McpError> {
    let unknown = || McpError::invalid_params(format!("no prompt {:?}", params.name), None);
    let (server, name) = params.name.split_once(SEPARATOR).ok_or_else(unknown)?;
    let up = upstreams
        .iter()
        .find(|u| u.name == server)
        .ok_or_else(unknown)?;
    let name = name.to_string();
    params.name = name;
    up.peer()
        .await
        .map_err(|e| failed(up, e))?
        .get_prompt_once(params)
        .await
        .map_err(|e| failed(up, e))
}
