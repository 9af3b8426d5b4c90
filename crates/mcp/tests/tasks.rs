//! Held calls as tasks (the SEP-2663 tasks extension): a client that declares the extension
//! gets a held call back at once as a task it polls (`tasks/get`) while an operator decides on
//! estop's channel; `tasks/cancel` ends the wait (nothing runs) or cuts the upstream call in
//! flight (recorded `unknown`). A client without it keeps the bounded wait (tests/gateway.rs).

mod common;

use common::*;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CancelTaskParams, ClientCapabilities, ClientConfig,
    GetTaskParams, Implementation, TaskStatus,
};
use rmcp::service::{RoleClient, RunningService};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

async fn tasks_client(w: &World, run: &str) -> RunningService<RoleClient, ClientConfig> {
    let caps = ClientCapabilities::builder().enable_tasks().build();
    let config = ClientConfig::new(caps, Implementation::new("tasks", "1"));
    w.client_as(config, run, "Echoes text.", 30_000).await
}

/// Calls `tool` and expects a task: its id and first state.
async fn call_task(c: &RunningService<RoleClient, ClientConfig>, tool: &str, text: &str) -> String {
    let mut p = CallToolRequestParams::new(tool.to_string());
    let Value::Object(args) = json!({"text": text}) else {
        unreachable!()
    };
    p.arguments = Some(args);
    match c.peer().call_tool_once(p).await.expect("an answer") {
        CallToolResponse::Task(t) => {
            assert_eq!(t.task.status, TaskStatus::Working);
            let says = t.task.status_message.clone().unwrap_or_default();
            assert!(says.contains("estop approve"), "{says}");
            t.task.task_id
        }
        other => panic!("not a task: {other:?}"),
    }
}

/// Polls `tasks/get` (as a client does) until the task leaves `working`.
async fn settled(c: &RunningService<RoleClient, ClientConfig>, id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = c.peer().get_task(GetTaskParams::new(id)).await.unwrap();
        if got.task.task.status != TaskStatus::Working {
            return serde_json::to_value(&got).unwrap();
        }
        assert!(Instant::now() < deadline, "the task never settled");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_call_is_a_task_that_runs_once_an_operator_approves() {
    let w = world();
    let c = tasks_client(&w, "run-task").await;
    let id = call_task(&c, "files__write", "hold-t").await;
    let got = c.peer().get_task(GetTaskParams::new(&id)).await.unwrap();
    assert_eq!(got.task.task.status, TaskStatus::Working);
    assert!(w.upstream().is_empty());
    let key = w.pending_key("run-task");
    let v =
        w.operator(json!({"op": "decide", "run": "run-task", "key": key, "decision": "approve"}));
    assert_eq!(v["ok"], true, "{v}");
    let done = settled(&c, &id).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(
        done["result"]["content"][0]["text"], "write: hold-t",
        "{done}"
    );
    assert_eq!(w.upstream(), ["call write hold-t"]);

    // Rejected: the task completes with the refusal the model reads; nothing runs.
    let id = call_task(&c, "files__write", "hold-r").await;
    let key = w.pending_key("run-task");
    let v =
        w.operator(json!({"op": "decide", "run": "run-task", "key": key, "decision": "reject"}));
    assert_eq!(v["ok"], true, "{v}");
    let done = settled(&c, &id).await;
    let said = done["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(said.starts_with("REFUSED, not run: rejected"), "{done}");
    assert_eq!(w.upstream(), ["call write hold-t"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_cancel_ends_the_wait_or_cuts_the_upstream_call() {
    let w = world();
    let c = tasks_client(&w, "run-tcancel").await;
    // Cancelled while held: nothing runs.
    let id = call_task(&c, "files__write", "hold-c").await;
    c.peer()
        .cancel_task(CancelTaskParams::new(&id))
        .await
        .unwrap();
    assert_eq!(settled(&c, &id).await["status"], "cancelled");
    assert!(w.upstream().is_empty(), "{:?}", w.upstream());
    // Its approval is still pending (approving it now would run nothing); while it is, the
    // run's other calls wait behind it: the operator clears it.
    let key = w.pending_key("run-tcancel");
    let v =
        w.operator(json!({"op": "decide", "run": "run-tcancel", "key": key, "decision": "reject"}));
    assert_eq!(v["ok"], true, "{v}");
    // Cancelled while the upstream runs it: the upstream hears the cancel, the effect is unknown.
    let id = call_task(&c, "files__block", "hold").await;
    let key = w.pending_key("run-tcancel");
    let v = w
        .operator(json!({"op": "decide", "run": "run-tcancel", "key": key, "decision": "approve"}));
    assert_eq!(v["ok"], true, "{v}");
    w.upstream_logged("call block hold").await;
    c.peer()
        .cancel_task(CancelTaskParams::new(&id))
        .await
        .unwrap();
    w.upstream_logged("cancelled block").await;
    assert_eq!(settled(&c, &id).await["status"], "cancelled");
    let report = w.operator(json!({"op": "report", "run": "run-tcancel"}));
    assert_eq!(report["unknown"][0]["tool"], "files__block", "{report}");
}

/// A task cancelled while its call was held, approved after: the gateway's `wait` still
/// consumed the approval (and so started the call); it used to stay `in_flight started` for
/// ever. It is completed as not sent, and nothing reaches the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_cancelled_while_held_and_approved_after_ends_not_sent() {
    let w = world();
    let run = "run-tlate";
    let c = tasks_client(&w, run).await;
    let id = call_task(&c, "files__write", "hold-l").await;
    let key = w.pending_key(run);
    c.peer()
        .cancel_task(CancelTaskParams::new(&id))
        .await
        .unwrap();
    assert_eq!(settled(&c, &id).await["status"], "cancelled");
    let v = w.operator(json!({"op": "decide", "run": run, "key": key, "decision": "approve"}));
    assert_eq!(v["ok"], true, "{v}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let report = w.operator(json!({"op": "report", "run": run}));
        if report["failed"].as_array().is_some_and(|f| !f.is_empty()) {
            assert_eq!(report["failed"][0]["key"], key.as_str(), "{report}");
            assert_eq!(report["in_flight"], json!([]), "{report}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the approved call was never completed: {report}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(w.upstream().is_empty(), "{:?}", w.upstream());
}
