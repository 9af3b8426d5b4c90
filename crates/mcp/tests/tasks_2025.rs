//! 2025-11-25's own task form (SEP-1686 as that revision published it: `params.task` on
//! `tools/call`, `tasks/get`, `tasks/result`, `tasks/list`, `tasks/cancel`,
//! `notifications/tasks/status`), end to end and hostile first. The client speaks that
//! revision's raw JSON-RPC on the gateway's byte stream (rmcp 3.11 models only SEP-2663; the
//! Python SDK's client at mcp 2.3.0 refuses the `CreateTaskResult`; the TypeScript SDK's
//! client speaks it, in clients/typescript/test/mcp.test.ts); the rmcp fixture upstream
//! logs every call and cancel it receives, so "nothing ran" is checked where it matters.
//! Over HTTP the same form is in tests/http_front.rs (`a_2025_11_25_task_is_its_principals_alone`).

mod common;

use common::*;
use serde_json::{Value, json};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, DuplexStream, ReadHalf, WriteHalf};

/// A client of the 2025-11-25 revision, by hand: JSON-RPC lines on the gateway's stdio.
struct Raw {
    w: WriteHalf<DuplexStream>,
    r: tokio::io::Lines<BufReader<ReadHalf<DuplexStream>>>,
    next: u64,
    /// Notifications met while waiting for answers.
    notes: Vec<Value>,
    /// What `initialize` answered.
    init: Value,
}

impl Raw {
    async fn start(w: &World, run: &str) -> Raw {
        let opts = w.options(run, "Echoes text.", 30_000);
        let (ours, theirs) = tokio::io::duplex(1 << 16);
        tokio::spawn(async move {
            estop_mcp::serve_io(opts, tokio::io::split(theirs))
                .await
                .unwrap();
        });
        let (r, wr) = tokio::io::split(ours);
        let mut c = Raw {
            w: wr,
            r: BufReader::new(r).lines(),
            next: 1,
            notes: Vec::new(),
            init: Value::Null,
        };
        c.init = c
            .request(
                "initialize",
                json!({"protocolVersion": "2025-11-25", "capabilities": {},
                    "clientInfo": {"name": "raw-2025-11-25", "version": "1"}}),
            )
            .await;
        c.send(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))
            .await;
        c
    }

    async fn send(&mut self, msg: Value) {
        self.w
            .write_all(format!("{msg}\n").as_bytes())
            .await
            .unwrap();
    }

    /// One request: its whole answer (`result` or `error`), notifications kept aside.
    async fn request(&mut self, method: &str, params: Value) -> Value {
        let id = self.next;
        self.next += 1;
        self.send(json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}))
            .await;
        self.answer(id).await
    }

    async fn answer(&mut self, id: u64) -> Value {
        loop {
            // Bounded only so that a gateway that never answers fails instead of hanging.
            let line = tokio::time::timeout(Duration::from_secs(60), self.r.next_line())
                .await
                .expect("an answer in time")
                .unwrap()
                .expect("the gateway is still there");
            let v: Value = serde_json::from_str(&line).unwrap();
            if v["id"] == json!(id) {
                return v;
            }
            if v.get("method").is_some() && v.get("id").is_none() {
                self.notes.push(v);
            }
        }
    }

    /// `tools/call` of `tool` with `{"text": text}`, augmented with a task: the task.
    async fn call_task(&mut self, tool: &str, text: &str) -> Value {
        let v = self
            .request(
                "tools/call",
                json!({"name": tool, "arguments": {"text": text}, "task": {"ttl": 600_000}}),
            )
            .await;
        assert!(v["result"]["task"]["taskId"].is_string(), "not a task: {v}");
        v["result"].clone()
    }

    async fn get(&mut self, id: &str) -> Value {
        self.request("tasks/get", json!({"taskId": id})).await
    }

    /// Polls `tasks/get` (as a client does) until the task leaves `working`.
    async fn settled(&mut self, id: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let got = self.get(id).await;
            if got["result"]["status"] != "working" {
                return got["result"].clone();
            }
            assert!(Instant::now() < deadline, "the task never settled: {got}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

fn task_id(created: &Value) -> String {
    created["task"]["taskId"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_or_unknown_call_as_a_task_runs_nothing() {
    let w = world();
    let mut c = Raw::start(&w, "run-t25-deny").await;
    // Denied by policy: the task exists (the form asks for one) and has already ended with the
    // refusal the model reads; `failed`, as the revision says of an `isError` tool result.
    let created = c.call_task("files__write", "nope").await;
    let id = task_id(&created);
    let said = created["_meta"]["io.modelcontextprotocol/model-immediate-response"]
        .as_str()
        .unwrap_or_default();
    assert!(said.starts_with("REFUSED, not run: denied"), "{created}");
    let done = c.settled(&id).await;
    assert_eq!(done["status"], "failed", "{done}");
    let r = c.request("tasks/result", json!({"taskId": id})).await;
    assert_eq!(r["result"]["isError"], true, "{r}");
    let text = r["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default();
    assert!(text.starts_with("REFUSED, not run: denied"), "{r}");
    assert_eq!(
        r["result"]["_meta"]["io.modelcontextprotocol/related-task"]["taskId"],
        json!(id)
    );
    // Cancelling a task that has ended is invalid params.
    let again = c.request("tasks/cancel", json!({"taskId": id})).await;
    assert_eq!(again["error"]["code"], -32602, "{again}");
    // An unknown tool is a protocol error, no task; an unknown task id is "no task".
    let v = c
        .request(
            "tools/call",
            json!({"name": "files__nothing", "arguments": {}, "task": {}}),
        )
        .await;
    assert!(v["error"].is_object(), "{v}");
    for method in ["tasks/get", "tasks/result", "tasks/cancel"] {
        let v = c.request(method, json!({"taskId": "made-up"})).await;
        assert!(v["error"].is_object(), "{method}: {v}");
    }
    assert!(w.upstream().is_empty(), "{:?}", w.upstream());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_call_is_a_2025_11_25_task_completed_with_the_recorded_result() {
    let w = world();
    let mut c = Raw::start(&w, "run-t25").await;
    // What rmcp cannot say, the edge does: the capability and each tool's support.
    let caps = &c.init["result"]["capabilities"];
    assert_eq!(
        caps["tasks"]["requests"]["tools"]["call"],
        json!({}),
        "{}",
        c.init
    );
    let tools = c.request("tools/list", json!({})).await;
    let tools = tools["result"]["tools"].as_array().unwrap().clone();
    assert!(!tools.is_empty());
    for t in &tools {
        assert_eq!(t["execution"]["taskSupport"], "optional", "{t}");
    }

    let created = c.call_task("files__write", "hold-25").await;
    let id = task_id(&created);
    assert_eq!(created["task"]["status"], "working", "{created}");
    let says = created["task"]["statusMessage"]
        .as_str()
        .unwrap_or_default();
    assert!(says.contains("estop approve run-t25"), "{created}");
    assert!(created["task"]["ttl"].is_u64() && created["task"]["pollInterval"].is_u64());
    let got = c.get(&id).await;
    assert_eq!(got["result"]["status"], "working", "{got}");
    assert!(w.upstream().is_empty(), "held: nothing ran");
    // The client lists its own task.
    let listed = c.request("tasks/list", json!({})).await;
    assert_eq!(
        listed["result"]["tasks"][0]["taskId"],
        json!(id),
        "{listed}"
    );

    // tasks/result blocks until the operator decides on estop's channel and the call ran.
    let result_id = c.next;
    c.next += 1;
    c.send(
        json!({"jsonrpc": "2.0", "id": result_id, "method": "tasks/result",
        "params": {"taskId": id}}),
    )
    .await;
    let key = w.pending_key("run-t25");
    let v =
        w.operator(json!({"op": "decide", "run": "run-t25", "key": key, "decision": "approve"}));
    assert_eq!(v["ok"], true, "{v}");
    let r = c.answer(result_id).await;
    assert_eq!(r["result"]["content"][0]["text"], "write: hold-25", "{r}");
    assert_eq!(w.upstream(), ["call write hold-25"]);
    assert_eq!(c.settled(&id).await["status"], "completed");
    // The end was told (`notifications/tasks/status`, which the revision makes optional).
    let told = c
        .notes
        .iter()
        .find(|n| n["method"] == "notifications/tasks/status")
        .unwrap_or_else(|| panic!("no status notification: {:?}", c.notes));
    assert_eq!(told["params"]["taskId"], json!(id));
    assert_eq!(told["params"]["status"], "completed");

    // The same call again is the same effect: a task that ends at once with the recorded
    // result; the upstream is not called twice.
    let again = c.call_task("files__write", "hold-25").await;
    let r = c
        .request("tasks/result", json!({"taskId": task_id(&again)}))
        .await;
    assert_eq!(r["result"]["content"][0]["text"], "write: hold-25", "{r}");
    assert_eq!(w.upstream(), ["call write hold-25"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_cancel_ends_a_2025_11_25_task_held_or_running() {
    let w = world();
    let mut c = Raw::start(&w, "run-t25c").await;
    // Cancelled while held: answered `cancelled`, nothing runs.
    let id = task_id(&c.call_task("files__write", "hold-c25").await);
    let v = c.request("tasks/cancel", json!({"taskId": id})).await;
    assert_eq!(v["result"]["status"], "cancelled", "{v}");
    assert_eq!(c.get(&id).await["result"]["status"], "cancelled");
    let r = c.request("tasks/result", json!({"taskId": id})).await;
    assert!(r["error"].is_object(), "{r}");
    assert!(w.upstream().is_empty(), "{:?}", w.upstream());
    let key = w.pending_key("run-t25c");
    let v =
        w.operator(json!({"op": "decide", "run": "run-t25c", "key": key, "decision": "reject"}));
    assert_eq!(v["ok"], true, "{v}");
    // Cancelled while the upstream runs it: the upstream hears the cancel, the effect is
    // recorded unknown, and the task stays cancelled.
    let id = task_id(&c.call_task("files__block", "hold").await);
    let key = w.pending_key("run-t25c");
    let v =
        w.operator(json!({"op": "decide", "run": "run-t25c", "key": key, "decision": "approve"}));
    assert_eq!(v["ok"], true, "{v}");
    w.upstream_logged("call block hold").await;
    let v = c.request("tasks/cancel", json!({"taskId": id})).await;
    assert_eq!(v["result"]["status"], "cancelled", "{v}");
    w.upstream_logged("cancelled block").await;
    assert_eq!(c.settled(&id).await["status"], "cancelled");
    let report = w.operator(json!({"op": "report", "run": "run-t25c"}));
    assert_eq!(report["unknown"][0]["tool"], "files__block", "{report}");
}
