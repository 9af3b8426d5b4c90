//! A small upstream MCP server built on `rmcp`, for the gateway's tests: it writes one line to
//! `$FIXTURE_LOG` for every call it receives and every cancel it sees, so a test can count what
//! reached the upstream. Tools: `echo {text}`, `write {text}` (destructive), `peek`
//! (read-only), `block` (runs until cancelled); a resource `fixture://notes` and a prompt
//! `greet`. `$FIXTURE_ECHO_DESC`, when set, is `echo`'s
//! description (a test changes it to play a server that rewrites its tools).

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, GetPromptRequestParams,
    GetPromptResponse, GetPromptResult, ListPromptsResult, ListResourcesResult, ListToolsResult,
    PaginatedRequestParams, Prompt, PromptMessage, ReadResourceRequestParams, ReadResourceResponse,
    ReadResourceResult, Resource, ResourceContents, Role, ServerCapabilities, ServerConfig, Tool,
    ToolAnnotations,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData as McpError, ServerHandler, ServiceExt};
use serde_json::json;
use std::io::Write;
use std::sync::Arc;

struct Fixture;

fn log(line: &str) {
    if let Ok(path) = std::env::var("FIXTURE_LOG") {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .expect("fixture log");
        writeln!(f, "{line}").expect("fixture log");
    }
}

fn tool(name: &'static str, desc: String, ann: ToolAnnotations) -> Tool {
    let schema = json!({"type": "object", "properties": {"text": {"type": "string"}}});
    let serde_json::Value::Object(schema) = schema else {
        unreachable!("an object literal")
    };
    Tool::new(name, desc, Arc::new(schema)).annotate(ann)
}

impl ServerHandler for Fixture {
    fn get_info(&self) -> ServerConfig {
        let mut caps = ServerCapabilities::builder().enable_tools().build();
        caps.resources = Some(Default::default());
        caps.prompts = Some(Default::default());
        ServerConfig::new(caps)
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        let echo = std::env::var("FIXTURE_ECHO_DESC").unwrap_or_else(|_| "Echoes text.".into());
        Ok(ListToolsResult::with_all_items(vec![
            tool("echo", echo, ToolAnnotations::new().destructive(false)),
            tool(
                "write",
                "Writes text.".into(),
                ToolAnnotations::new().destructive(true),
            ),
            tool(
                "peek",
                "Reads.".into(),
                ToolAnnotations::new().read_only(true),
            ),
            tool(
                "block",
                "Runs until cancelled.".into(),
                ToolAnnotations::new(),
            ),
        ]))
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, McpError> {
        let notes = Resource::new("fixture://notes", "notes");
        Ok(ListResourcesResult::with_all_items(vec![notes]))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, McpError> {
        log(&format!("read {}", request.uri));
        let text = ResourceContents::text("the notes", request.uri);
        Ok(ReadResourceResult::new(vec![text]).into())
    }

    async fn list_prompts(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListPromptsResult, McpError> {
        let greet = Prompt::new("greet", Some("Greets."), None);
        Ok(ListPromptsResult::with_all_items(vec![greet]))
    }

    async fn get_prompt(
        &self,
        request: GetPromptRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<GetPromptResponse, McpError> {
        let said = PromptMessage::new_text(Role::User, format!("hello from {}", request.name));
        Ok(GetPromptResult::new(vec![said]).into())
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let text = request
            .arguments
            .as_ref()
            .and_then(|a| a.get("text"))
            .and_then(|t| t.as_str())
            .unwrap_or("")
            .to_string();
        log(&format!("call {} {text}", request.name));
        if request.name == "block" {
            context.ct.cancelled().await;
            log("cancelled block");
            return Err(McpError::internal_error("cancelled", None));
        }
        Ok(CallToolResult::success(vec![ContentBlock::text(format!(
            "{}: {text}",
            request.name
        ))])
        .into())
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let service = Fixture.serve(rmcp::transport::stdio()).await?;
    service.waiting().await?;
    Ok(())
}
