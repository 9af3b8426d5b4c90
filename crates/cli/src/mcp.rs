//! `estop mcp`: the command's flags, handed to `estop_mcp::serve_stdio` or, with `--listen`,
//! `estop_mcp::serve_http` (docs/MCP.md).

use clap::Args;
use std::path::PathBuf;

#[derive(Args)]
pub struct McpArgs {
    /// The gateway's configuration (TOML: [gateway] hold_ms, tasks_running_max,
    /// tasks_kept_max, tasks_per_principal_max, task_ttl_ms; [runs]; [http]; [[server]] name,
    /// command or url, args, env, headers, trusted, sandbox, sandbox_policy; docs/MCP.md).
    #[arg(long)]
    config: PathBuf,
    /// The run every tool call belongs to (default: a fresh `mcp-…` per session).
    #[arg(long)]
    run: Option<String>,
    /// The parent run (a cancel of the parent reaches this run).
    #[arg(long)]
    parent: Option<String>,
    /// Data directory of the daemon (its socket and agent token; the tool pins are kept here).
    #[arg(long, env = "ESTOP_DATA", default_value = "estop-data")]
    data: PathBuf,
    /// Socket path of the daemon (default: DATA/estop.sock).
    #[arg(long, env = "ESTOP_SOCKET")]
    socket: Option<String>,
    /// The agent token the run belongs to, on stdio (default: DATA/agent.token); over HTTP
    /// each client presents its own.
    #[arg(long, env = "ESTOP_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Serve MCP over streamable HTTP on this address (e.g. 127.0.0.1:7422) instead of stdio;
    /// every request needs an estop agent token (`Authorization: Bearer`).
    #[arg(long)]
    listen: Option<String>,
}

/// Serves MCP on stdin/stdout until the client closes it.
pub fn run(a: McpArgs) -> anyhow::Result<u8> {
    let opts = estop_mcp::Options {
        config: a.config,
        data: a.data,
        socket: a.socket,
        token: a.token,
        run: a.run,
        parent: a.parent,
        estop: None,
    };
    match a.listen {
        Some(addr) => estop_mcp::serve_http(opts, &addr)?,
        None => estop_mcp::serve_stdio(opts)?,
    }
    Ok(0)
}
