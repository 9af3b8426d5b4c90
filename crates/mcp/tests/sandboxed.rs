//! A stdio upstream inside `estop run`'s sandbox (docs/MCP.md, "Upstreams inside `estop run`'s
//! sandbox"): the gateway's command is `estop run … -- UPSTREAM`, MCP crosses the sandbox's
//! stdio unchanged, the calls are still gated as the gateway's run, and the upstream runs as a
//! sandboxed run of its own, a child of the gateway's, so a cancel of the gateway's run ends it.

mod common;

use common::*;
use serde_json::json;
use std::path::PathBuf;

/// The `estop` binary of this build, beside the fixture (`cargo nextest run --workspace` and
/// `cargo build` build both into the same directory).
fn estop_bin() -> PathBuf {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_estop-mcp-fixture")).with_file_name("estop");
    assert!(
        bin.exists(),
        "{} is not built: build the workspace (`cargo build -p estop`) before this test",
        bin.display()
    );
    bin
}

/// The documented recipe: the server's command is `estop run … -- fixture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxed_upstream_is_gated_and_fenced_with_the_gateways_run() {
    let w = world();
    let args = [
        "run",
        "--data",
        &w.data.display().to_string(),
        "--run",
        "gw/files",
        "--parent",
        "gw",
        "--",
        env!("CARGO_BIN_EXE_estop-mcp-fixture"),
    ]
    .map(|a| format!("{a:?}"))
    .join(", ");
    let server = format!(
        "command = {:?}\nargs = [{args}]\n",
        estop_bin().display().to_string()
    );
    gated_and_fenced(&w, &server, None).await;
}

/// The shorthand: `sandbox = true` makes the gateway start the same `estop run` itself, the
/// sandbox's run `gw/files` a child of the gateway's `--run gw`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_true_upstream_is_the_recipe_without_spelling_it() {
    let w = world();
    let server = format!(
        "command = {:?}\nsandbox = true\n",
        env!("CARGO_BIN_EXE_estop-mcp-fixture")
    );
    gated_and_fenced(&w, &server, Some(estop_bin())).await;
}

/// The gateway (`--run gw`) in front of the fixture upstream `server` (its `command` and
/// `args`, or `sandbox = true`): a call is answered through the sandbox's stdio and gated as
/// `gw`, the sandbox is the child run `gw/files`, fenced by `gw`'s cancel and cancelled once
/// the gateway closes.
async fn gated_and_fenced(w: &World, server: &str, estop: Option<PathBuf>) {
    let config = w.data.parent().unwrap().join("mcp-sandboxed.toml");
    let toml = format!(
        "[gateway]\nhold_ms = 30000\n\n[[server]]\nname = \"files\"\n{server}\
         env = {{ FIXTURE_LOG = {:?}, FIXTURE_ECHO_DESC = \"Echoes text.\" }}\n",
        w.log.display().to_string(),
    );
    std::fs::write(&config, toml).unwrap();
    let opts = estop_mcp::Options {
        config,
        data: w.data.clone(),
        socket: Some(w.socket.clone()),
        token: None,
        run: Some("gw".into()),
        parent: None,
        estop,
    };
    let c = w.client_on(opts).await;
    let reply = call(&c, "files__echo", "from the sandbox").await;
    assert_eq!(text(&reply), "echo: from the sandbox");
    assert_eq!(w.upstream(), ["call echo from the sandbox"]);
    let report = w.operator(json!({"op": "report", "run": "gw"}));
    assert_eq!(report["done"][0]["tool"], "files__echo", "{report}");
    // The upstream is a sandboxed run, a child of the gateway's.
    let sandbox = w.operator(json!({"op": "status", "run": "gw/files"}));
    assert_eq!(
        (sandbox["state"].as_str(), sandbox["parent"].as_str()),
        (Some("active"), Some("gw")),
        "{sandbox}"
    );
    // A cancel of the gateway's run fences the sandbox's run too (its network is shut; a kill
    // would also end its processes); once the gateway closes, the upstream's exit settles the
    // launch and the sandbox's run is cancelled.
    w.operator(json!({"op": "cancel", "run": "gw", "reason": "stop"}));
    let fenced = w.operator(json!({"op": "status", "run": "gw/files"}));
    assert_eq!(fenced["cause"], "cancelled", "{fenced}");
    c.cancel().await.unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let s = w.operator(json!({"op": "status", "run": "gw/files"}));
        if s["state"] == "cancelled" {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{s}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
