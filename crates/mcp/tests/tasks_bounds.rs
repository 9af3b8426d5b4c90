//! The tasks' bounds, hostile first, over HTTP (where principals share one gateway), with small
//! bounds from `[gateway]`: a principal at its share (`tasks_per_principal_max`) gets the answer
//! of the global bounds — the bounded wait for a SEP-2663 client, `-32600` for a 2025-11-25
//! task — while other principals still get tasks; at `tasks_running_max` or `tasks_kept_max`
//! everyone gets it; tasks of both forms count; once a principal's tasks ended and were
//! forgotten (their TTL after they ended), it gets tasks again. On stdio (one principal) the
//! share is the kept bound.

mod common;

use common::web::*;
use common::*;
use rmcp::ServiceExt;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CancelTaskParams, ClientCapabilities, ClientConfig,
    GetTaskParams, Implementation, TaskStatus,
};
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::streamable_http_client::{
    StreamableHttpClientTransport, StreamableHttpClientTransportConfig,
};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// Three running, four kept, two a principal; a task lives a second.
const BOUNDS: &str = "tasks_running_max = 3\ntasks_kept_max = 4\ntasks_per_principal_max = 2\n\
                      task_ttl_ms = 1000";
/// The bounded wait, short.
const HOLD_MS: u64 = 300;

type Client = RunningService<RoleClient, ClientConfig>;

/// An rmcp client over HTTP that declares the tasks extension (SEP-2663), as `token`.
async fn tasks_client(addr: &str, token: &str) -> Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let caps = ClientCapabilities::builder().enable_tasks().build();
    let config = StreamableHttpClientTransportConfig::with_uri(format!("http://{addr}/mcp"))
        .auth_header(token);
    ClientConfig::new(caps, Implementation::new("tasks", "1"))
        .serve(StreamableHttpClientTransport::from_config(config))
        .await
        .unwrap()
}

/// A held call (`files__write` of `hold-…`): its task id, or what it answered instead.
async fn held(c: &Client, text: &str) -> Result<String, String> {
    let mut p = CallToolRequestParams::new("files__write");
    let Value::Object(args) = json!({"text": text}) else {
        unreachable!()
    };
    p.arguments = Some(args);
    match c.peer().call_tool_once(p).await.expect("an answer") {
        CallToolResponse::Task(t) => Ok(t.task.task_id),
        CallToolResponse::Complete(r) => Err(text_of(&r)),
        other => panic!("{other:?}"),
    }
}

fn text_of(r: &rmcp::model::CallToolResult) -> String {
    r.content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect()
}

/// A held call that gets no task: the bounded wait's answer, after the wait.
async fn waited(c: &Client, text: &str) {
    let t = Instant::now();
    let said = held(c, text).await.expect_err("no task");
    assert!(said.starts_with("HELD, not run"), "{said}");
    assert!(t.elapsed() >= Duration::from_millis(HOLD_MS), "the wait");
}

/// Cancels a held task and waits until it ended `cancelled`.
async fn cancel(c: &Client, id: &str) {
    c.peer()
        .cancel_task(CancelTaskParams::new(id))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = c.peer().get_task(GetTaskParams::new(id)).await.unwrap();
        if got.task.task.status == TaskStatus::Cancelled {
            return;
        }
        assert!(Instant::now() < deadline, "never cancelled: {got:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Tries `attempt` until it is `Ok` (what was kept must be forgotten first: a TTL after the
/// end, so seconds here).
async fn eventually<F, Fut, T, E: std::fmt::Debug>(mut attempt: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match attempt().await {
            Ok(v) => return v,
            Err(e) => assert!(Instant::now() < deadline, "never: {e:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_principal_at_its_share_gets_the_bounded_wait_while_others_get_tasks() {
    let w = world();
    let addr = http_gateway_with(&w, "share", HOLD_MS, BOUNDS, "").await;
    let alice = tasks_client(&addr, &agent_token(&w, "alice")).await;
    let bob = tasks_client(&addr, &agent_token(&w, "bob")).await;
    let carol = tasks_client(&addr, &agent_token(&w, "carol")).await;
    let a1 = held(&alice, "hold-a1").await.expect("a task");
    let a2 = held(&alice, "hold-a2").await.expect("a task");
    // Alice is at her share: her next held call is the bounded wait, not a task.
    waited(&alice, "hold-a3").await;
    // Bob still gets one; now three run, the global bound: Carol, who has none, waits too.
    held(&bob, "hold-b1").await.expect("Bob's share is his own");
    waited(&carol, "hold-c1").await;
    // Alice's cancelled tasks stop running (Carol gets one) but are kept their TTL for her,
    // still in her share; once forgotten, she gets tasks again.
    cancel(&alice, &a1).await;
    cancel(&alice, &a2).await;
    held(&carol, "hold-c1")
        .await
        .expect("a running slot is free");
    eventually(|| held(&alice, "hold-a3")).await;
    assert!(w.upstream().is_empty(), "{:?}", w.upstream());
}

/// A 2025-11-25 task call: its task id, or the error (a refused call is not a task).
async fn task_25(s: &Session25, text: &str) -> Result<String, Value> {
    let v = s
        .send(
            "tools/call",
            json!({"name": "files__write", "arguments": {"text": text}, "task": {"ttl": 1000}}),
        )
        .await;
    match v["result"]["task"]["taskId"].as_str() {
        Some(id) => Ok(id.to_string()),
        None => Err(v["error"].clone()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_2025_11_25_task_past_a_share_or_the_kept_bound_is_refused() {
    let w = world();
    let addr = http_gateway_with(&w, "share25", HOLD_MS, BOUNDS, "").await;
    let alice_token = agent_token(&w, "alice25");
    let alice = Session25::open(&addr, &alice_token).await;
    let alice_ext = tasks_client(&addr, &alice_token).await;
    // Both forms count: one held SEP-2663 task, then a 2025-11-25 one (denied: it has ended).
    let held_id = held(&alice_ext, "hold-x").await.expect("a task");
    task_25(&alice, "nope-a1").await.expect("a task");
    let e = task_25(&alice, "nope-a2")
        .await
        .expect_err("past her share");
    assert_eq!(e["code"], -32600, "{e}");
    let said = e["message"].as_str().unwrap_or_default();
    assert!(
        said.contains("its share") && said.contains("alice25"),
        "{e}"
    );
    // Bob gets his two; four are kept, the global bound: Carol, who has none, is refused.
    let bob = Session25::open(&addr, &agent_token(&w, "bob25")).await;
    task_25(&bob, "nope-b1")
        .await
        .expect("Bob's share is his own");
    task_25(&bob, "nope-b2")
        .await
        .expect("Bob's share is his own");
    let carol = Session25::open(&addr, &agent_token(&w, "carol25")).await;
    let e = task_25(&carol, "nope-c1")
        .await
        .expect_err("the kept bound");
    assert_eq!(e["code"], -32600, "{e}");
    assert!(
        e["message"].as_str().unwrap_or_default().contains("kept"),
        "{e}"
    );
    // Ended tasks are forgotten a TTL after they end: Carol, then Alice (her held task
    // cancelled), get tasks again.
    cancel(&alice_ext, &held_id).await;
    eventually(|| task_25(&carol, "nope-c1")).await;
    eventually(|| task_25(&alice, "nope-a2")).await;
    assert!(w.upstream().is_empty(), "{:?}", w.upstream());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_2025_11_25_task_calls_do_not_overrun_a_share() {
    let w = world();
    let addr = http_gateway_with(&w, "race25", HOLD_MS, BOUNDS, "").await;
    let token = agent_token(&w, "racer");
    // Six at once, one principal in six sessions: the share is checked and taken in one step,
    // not checked, then taken after the gate answered.
    let mut sessions = Vec::new();
    for _ in 0..6 {
        sessions.push(Session25::open(&addr, &token).await);
    }
    let calls: Vec<_> = sessions
        .into_iter()
        .enumerate()
        .map(|(i, s)| tokio::spawn(async move { task_25(&s, &format!("nope-{i}")).await }))
        .collect();
    let mut tasks = 0;
    for c in calls {
        match c.await.unwrap() {
            Ok(_) => tasks += 1,
            Err(e) => assert_eq!(e["code"], -32600, "{e}"),
        }
    }
    assert_eq!(tasks, 2, "her share is two");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_stdio_the_one_principal_has_every_slot() {
    let w = world();
    let opts = w.options("run-stdio-share", "Echoes text.", HOLD_MS);
    let text = std::fs::read_to_string(&opts.config).unwrap();
    let text = text.replacen("[gateway]\n", &format!("[gateway]\n{BOUNDS}\n"), 1);
    std::fs::write(&opts.config, text).unwrap();
    let (ours, theirs) = tokio::io::duplex(1 << 16);
    tokio::spawn(async move {
        estop_mcp::serve_io(opts, tokio::io::split(theirs))
            .await
            .unwrap();
    });
    let caps = ClientCapabilities::builder().enable_tasks().build();
    let c = ClientConfig::new(caps, Implementation::new("tasks", "1"))
        .serve(tokio::io::split(ours))
        .await
        .unwrap();
    // Past the share of two, up to the running bound of three; then the bounded wait.
    for text in ["hold-s1", "hold-s2", "hold-s3"] {
        held(&c, text).await.expect("a task");
    }
    waited(&c, "hold-s4").await;
}
