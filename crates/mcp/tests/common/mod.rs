//! What the gateway's end-to-end tests share: a real daemon in this process on a fresh data dir,
//! the gateway's options in front of the rmcp fixture upstream (a child process that logs every
//! call and cancel it receives), an operator connection, and small MCP client helpers.
#![allow(dead_code)] // each test file uses its own part

pub mod web;

use estop_mcp::Options;
use rmcp::ServiceExt;
use rmcp::model::{CallToolRequestParams, CallToolResult};
use rmcp::service::{RoleClient, RunningService};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const POLICY: &str = r#"
[defaults]
unknown_tool = "deny"

[[rules]]
tool = "files__echo"
action = "allow"

[[rules]]
tool = "sandbox.run"
action = "allow"

[[rules]]
tool = "files__block"
when = 'has(args.text) && args.text == "hold"'
action = "approve"

[[rules]]
tool = "files__block"
action = "allow"

[[rules]]
tool = "files__mutate"
action = "allow"

[[rules]]
tool = "files__die"
action = "allow"

[[rules]]
tool = "files__peek"
action = "allow"
class = "read"

[[rules]]
tool = "files__write"
when = 'args.text.startsWith("hold")'
action = "approve"

[[rules]]
tool = "files__write"
action = "deny"
"#;

pub struct World {
    pub _dir: tempfile::TempDir,
    pub data: PathBuf,
    pub socket: String,
    pub log: PathBuf,
    /// Whether the next gateway marks the fixture `trusted`.
    pub trusted: std::cell::Cell<bool>,
}

/// A daemon on a fresh data dir with the policy above, started in a thread of this process
/// (it lives until the test process ends); returns once it is ready.
pub fn world() -> World {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let policy = dir.path().join("policy.toml");
    std::fs::write(&policy, POLICY).unwrap();
    let mut opts = estop_server::ServeOptions::new(data.clone());
    opts.policy = Some(policy);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        estop_server::run(opts, |ready| {
            tx.send(ready.socket.display().to_string()).unwrap();
        })
        .unwrap();
    });
    let socket = rx.recv().expect("the daemon became ready");
    let log = dir.path().join("upstream.log");
    World {
        _dir: dir,
        data,
        socket,
        log,
        trusted: false.into(),
    }
}

impl World {
    /// The gateway in front of the fixture (its `echo` described as `echo_desc`), and an rmcp
    /// client connected to it.
    pub async fn client(
        &self,
        run: &str,
        echo_desc: &str,
        hold_ms: u64,
    ) -> RunningService<RoleClient, ()> {
        self.client_as((), run, echo_desc, hold_ms).await
    }

    /// `client`, with `handler` as the client (its config says which protocol revision it asks).
    pub async fn client_as<H: rmcp::ClientHandler>(
        &self,
        handler: H,
        run: &str,
        echo_desc: &str,
        hold_ms: u64,
    ) -> RunningService<RoleClient, H> {
        let opts = self.options(run, echo_desc, hold_ms);
        let (ours, theirs) = tokio::io::duplex(1 << 16);
        tokio::spawn(async move {
            estop_mcp::serve_io(opts, tokio::io::split(theirs))
                .await
                .unwrap();
        });
        handler
            .serve(tokio::io::split(ours))
            .await
            .expect("the gateway initializes")
    }

    /// An rmcp client to a gateway on `opts` (on a byte stream).
    pub async fn client_on(&self, opts: Options) -> RunningService<RoleClient, ()> {
        let (ours, theirs) = tokio::io::duplex(1 << 16);
        tokio::spawn(async move {
            estop_mcp::serve_io(opts, tokio::io::split(theirs))
                .await
                .unwrap();
        });
        ().serve(tokio::io::split(ours))
            .await
            .expect("the gateway initializes")
    }

    /// The gateway's options and configuration file for `run`.
    pub fn options(&self, run: &str, echo_desc: &str, hold_ms: u64) -> Options {
        let config = self
            .data
            .parent()
            .unwrap()
            .join(format!("mcp-{run}-{hold_ms}.toml"));
        let text = format!(
            "[gateway]\nhold_ms = {hold_ms}\n\n[[server]]\nname = \"files\"\ncommand = {:?}\n\
             trusted = {}\n\
             env = {{ FIXTURE_LOG = {:?}, FIXTURE_ECHO_DESC = {:?} }}\n",
            env!("CARGO_BIN_EXE_estop-mcp-fixture"),
            self.trusted.get(),
            self.log.display().to_string(),
            echo_desc
        );
        std::fs::write(&config, text).unwrap();
        Options {
            config,
            data: self.data.clone(),
            socket: Some(self.socket.clone()),
            token: None,
            run: Some(run.to_string()),
            parent: None,
            estop: None,
        }
    }

    /// The upstream's log lines so far.
    pub fn upstream(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Waits until the upstream logged `line` (it runs in another process).
    pub async fn upstream_logged(&self, line: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.upstream().iter().any(|l| l == line) {
            assert!(
                Instant::now() < deadline,
                "the upstream never logged {line:?}: {:?}",
                self.upstream()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// One operator request on its own connection.
    pub fn operator(&self, req: Value) -> Value {
        let token = std::fs::read_to_string(self.data.join("operator.token")).unwrap();
        let s = std::os::unix::net::UnixStream::connect(&self.socket).unwrap();
        let mut w = s.try_clone().unwrap();
        let mut r = BufReader::new(s);
        let mut line = String::new();
        writeln!(
            w,
            "{}",
            json!({"id": 1, "op": "hello", "token": token.trim()})
        )
        .unwrap();
        r.read_line(&mut line).unwrap();
        let mut req = req;
        req["id"] = json!(2);
        writeln!(w, "{req}").unwrap();
        line.clear();
        r.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap()
    }

    /// The key of the run's one pending approval.
    pub fn pending_key(&self, run: &str) -> String {
        let v = self.operator(json!({"op": "pending", "run": run}));
        let items = v["pending"]
            .as_array()
            .unwrap_or_else(|| panic!("pending: {v}"));
        assert_eq!(items.len(), 1, "{v}");
        items[0]["key"].as_str().unwrap().to_string()
    }
}

pub async fn call<H: rmcp::ClientHandler>(
    c: &RunningService<RoleClient, H>,
    tool: &str,
    text: &str,
) -> CallToolResult {
    let mut p = CallToolRequestParams::new(tool.to_string());
    let serde_json::Value::Object(args) = json!({"text": text}) else {
        unreachable!()
    };
    p.arguments = Some(args);
    c.peer().call_tool(p).await.expect("a tools/call answer")
}

/// `call` with `meta` as the request's `_meta`.
pub async fn call_meta(
    c: &RunningService<RoleClient, ()>,
    tool: &str,
    text: &str,
    meta: Value,
) -> Result<CallToolResult, rmcp::ServiceError> {
    let mut p = CallToolRequestParams::new(tool.to_string());
    let Value::Object(args) = json!({"text": text}) else {
        unreachable!()
    };
    p.arguments = Some(args);
    let Value::Object(meta) = meta else {
        unreachable!()
    };
    p.meta = Some(rmcp::model::RequestMetaObject(meta.into()));
    c.peer().call_tool(p).await
}

pub fn text(r: &CallToolResult) -> String {
    r.content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect()
}
