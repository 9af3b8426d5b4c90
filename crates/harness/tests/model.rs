//! The model client against the scripted server: the exact request, tool calls handed over
//! only at the terminal event, a stream cut within its grace (the server sees the client go),
//! and 429/5xx/4xx, a truncated body and a `length` finish mid tool call never a call.

use estop_harness::chat::{Finish, Message, Overflow, Reply, ToolCall};
use estop_harness::model::{CallRequest, ModelClient};
use estop_harness::scripted::{self, Script, Scripted, Seen, Step};
use std::time::Duration;
use tokio::sync::watch;

fn request() -> CallRequest {
    CallRequest {
        model: "m-1".into(),
        messages: vec![
            Message::system("be brief"),
            Message::user("drop the staging table"),
        ],
        tools: vec![
            serde_json::json!({"type": "function", "function": {"name": "drop_table", "parameters": {}}}),
        ],
        max_tokens: 64,
        deadline: Duration::from_secs(30),
    }
}

async fn server(responses: Vec<Vec<Step>>) -> (Scripted, ModelClient) {
    let s = Scripted::start("127.0.0.1:0", Script { responses })
        .await
        .unwrap();
    let c = ModelClient::new(&s.base_url(), Some("sk-test".into())).unwrap();
    (s, c)
}

#[tokio::test]
async fn a_tool_call_is_handed_over_only_after_the_terminal_event() {
    let (s, c) = server(vec![vec![
        scripted::tool_start(0, "call_1", "drop_table", "{\"db\": \"prod\", "),
        Step::Gate,
        scripted::tool_args(0, "\"table\": \"orders_staging\"}"),
        Step::Gate,
        scripted::finish("tool_calls"),
        scripted::usage(100, 40, 12),
        Step::Done,
    ]])
    .await;
    let (_tx, cut) = watch::channel(false);
    let req = request();
    let call = tokio::spawn({
        let c = c.clone();
        async move { c.call(&req, cut, Duration::from_millis(200)).await }
    });
    s.wait_for(&Seen::Call { n: 0 }).await;
    s.release(1);
    // The arguments are complete now, but the finish is behind the second gate: no reply.
    tokio::task::yield_now().await;
    assert!(!call.is_finished());
    s.release(1);
    let reply = call.await.unwrap();
    let Reply::Finished {
        finish,
        tool_calls,
        usage,
        ..
    } = reply
    else {
        panic!("{reply:?}")
    };
    assert_eq!(finish, Finish::ToolCalls);
    assert_eq!(
        tool_calls,
        [ToolCall::new(
            "call_1",
            "drop_table",
            "{\"db\": \"prod\", \"table\": \"orders_staging\"}"
        )]
    );
    let u = usage.unwrap();
    assert_eq!((u.uncached_input, u.cached_input, u.output), (60, 40, 12));
    let calls = s.calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["model"], "m-1");
    assert_eq!(calls[0]["max_tokens"], 64);
    assert_eq!(calls[0]["stream"], true);
    assert_eq!(calls[0]["stream_options"]["include_usage"], true);
    assert_eq!(calls[0]["messages"][1]["content"], "drop the staging table");
    assert_eq!(calls[0]["tools"][0]["function"]["name"], "drop_table");
}

#[tokio::test]
async fn a_cut_ends_the_call_within_its_grace_and_closes_the_stream() {
    let (s, c) = server(vec![vec![
        scripted::tool_start(
            0,
            "call_1",
            "drop_table",
            "{\"action\": \"drop_table\", \"target\": \"cust",
        ),
        Step::Gate,
        scripted::tool_args(0, "omers\"}"),
        scripted::finish("tool_calls"),
        Step::Done,
    ]])
    .await;
    let (tx, cut) = watch::channel(false);
    let req = request();
    let call = tokio::spawn({
        let c = c.clone();
        async move { c.call(&req, cut, Duration::from_millis(50)).await }
    });
    s.wait_for(&Seen::Call { n: 0 }).await;
    tx.send(true).unwrap();
    // The gate is never released: only the cut can end this call.
    let reply = call.await.unwrap();
    assert!(matches!(reply, Reply::Cut { .. }), "{reply:?}");
    // The connection is gone, so the provider stops generating (and billing).
    s.wait_for(&Seen::Gone { n: 0, step: 1 }).await;
}

#[tokio::test]
async fn a_reply_that_finishes_within_the_grace_still_counts() {
    let (s, c) = server(vec![scripted::answer("done")]).await;
    let (tx, cut) = watch::channel(false);
    tx.send(true).unwrap();
    // Cut before it began, with a grace long enough for the whole (ungated) reply.
    let reply = c.call(&request(), cut, Duration::from_secs(30)).await;
    assert!(
        matches!(
            reply,
            Reply::Finished {
                finish: Finish::Stop,
                ..
            }
        ),
        "{reply:?}"
    );
    drop(s);
}

#[tokio::test]
async fn errors_truncation_and_length_are_never_calls() {
    // An HTTP date 30 s ahead, as a provider's `Retry-After` may give it.
    let at = httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(30));
    let (s, c) = server(vec![
        vec![
            Step::Header {
                name: "Retry-After".into(),
                value: "7".into(),
            },
            Step::Status {
                status: 429,
                body: "{\"error\": \"rate\"}".into(),
            },
        ],
        vec![
            Step::Header {
                name: "retry-after".into(),
                value: at,
            },
            Step::Status {
                status: 503,
                body: "busy".into(),
            },
        ],
        vec![Step::Status {
            status: 400,
            body: "bad".into(),
        }],
        // The body ends mid tool call, without a finish.
        vec![
            scripted::tool_start(0, "c", "drop_table", "{\"target\": \"cu"),
            Step::Hangup,
        ],
        // `length` in the middle of a tool call's arguments.
        vec![
            scripted::tool_start(0, "c", "drop_table", "{\"target\": \"cu"),
            scripted::finish("length"),
            scripted::usage(10, 0, 64),
            Step::Done,
        ],
        // A finish of `tool_calls` whose arguments never closed.
        vec![
            scripted::tool_start(0, "c", "drop_table", "{\"target\": \"cu"),
            scripted::finish("tool_calls"),
            Step::Done,
        ],
    ])
    .await;
    let (_tx, cut) = watch::channel(false);
    let mut replies = Vec::new();
    for _ in 0..6 {
        replies.push(
            c.call(&request(), cut.clone(), Duration::from_millis(50))
                .await,
        );
    }
    let retryable: Vec<Option<bool>> = replies
        .iter()
        .map(|r| match r {
            Reply::Failed { retryable, .. } => Some(*retryable),
            _ => None,
        })
        .collect();
    assert_eq!(
        retryable[..4],
        [Some(true), Some(true), Some(false), Some(true)],
        "{replies:?}"
    );
    // `Retry-After` in seconds and as an HTTP date, on the retryable answers.
    let after: Vec<Option<u64>> = replies[..3]
        .iter()
        .map(|r| match r {
            Reply::Failed { retry_after_ms, .. } => *retry_after_ms,
            _ => None,
        })
        .collect();
    assert_eq!(after[0], Some(7_000), "{replies:?}");
    assert!(
        after[1].is_some_and(|ms| (28_000..=30_000).contains(&ms)),
        "{after:?}"
    );
    assert_eq!(after[2], None);
    match &replies[4] {
        Reply::Finished {
            finish: Finish::Length,
            tool_calls,
            usage,
            ..
        } => {
            assert!(tool_calls.is_empty(), "a cut-off call is discarded");
            assert_eq!(usage.unwrap().output, 64, "and still paid for");
        }
        other => panic!("{other:?}"),
    }
    // Arguments that never closed are the model's mistake, not a failed call: the reply is
    // handed over with the call, whose arguments the record answers as a tool error.
    match &replies[5] {
        Reply::Finished {
            finish: Finish::ToolCalls,
            tool_calls,
            ..
        } => {
            assert_eq!(tool_calls.len(), 1);
            let problem = estop_harness::chat::argument_problem(&tool_calls[0]).unwrap();
            assert!(problem.contains("not valid JSON"), "{problem}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(s.calls().len(), 6);
}

#[tokio::test]
async fn a_call_past_its_deadline_fails_and_is_retryable() {
    let (s, c) = server(vec![vec![
        scripted::text("thinking"),
        Step::Gate,
        scripted::finish("stop"),
        Step::Done,
    ]])
    .await;
    let (_tx, cut) = watch::channel(false);
    let mut req = request();
    req.deadline = Duration::from_millis(100);
    let reply = c.call(&req, cut, Duration::from_millis(10)).await;
    assert!(
        matches!(reply, Reply::Failed { retryable: true, ref error, .. } if error.contains("deadline")),
        "{reply:?}"
    );
    drop(s);
}

/// Issue 27, hostile: a tool call delta with `index: 10^12` (once made the client push empty
/// calls until the allocator aborted the process). Now the call is cut at the delta: the reply
/// is the typed overflow, the connection is closed (the rest of the stream, a well-formed
/// finish, is never read) and no call is handed over.
#[tokio::test]
async fn a_tool_call_index_of_a_trillion_is_cut_with_a_typed_overflow() {
    let (s, c) = server(vec![vec![
        scripted::tool_start(1_000_000_000_000, "c1", "drop_table", "{}"),
        Step::Gate,
        scripted::finish("tool_calls"),
        Step::Done,
    ]])
    .await;
    let (_tx, cut) = watch::channel(false);
    let reply = c.call(&request(), cut, Duration::from_millis(50)).await;
    assert_eq!(
        reply,
        Reply::Overflow {
            overflow: Overflow::ToolCalls {
                index: 1_000_000_000_000,
                max: estop_harness::model::TOOL_CALLS_MAX
            },
            usage: None
        }
    );
    s.wait_for(&Seen::Gone { n: 0, step: 1 }).await;
}

/// Issue 27, hostile: an event that never ends (64 KiB frames with no blank line, for ever)
/// once pegged a core rescanning the buffer until the call's deadline. Now it is cut at its
/// byte bound, long before the deadline, and the connection is closed.
#[tokio::test]
async fn an_endless_stream_event_is_cut_at_its_byte_bound() {
    let (s, c) = server(vec![vec![
        Step::Raw {
            data: "data: {\"choices\": [".into(),
            repeat: 1,
        },
        Step::Raw {
            data: "x".repeat(64 << 10),
            repeat: 1_000_000,
        },
    ]])
    .await;
    let (_tx, cut) = watch::channel(false);
    let started = std::time::Instant::now();
    let reply = c.call(&request(), cut, Duration::from_millis(50)).await;
    assert_eq!(
        reply,
        Reply::Overflow {
            overflow: Overflow::EventBytes {
                max: estop_harness::model::EVENT_BYTES_MAX
            },
            usage: None
        }
    );
    // The deadline is 30 s; the bound is reached after 1 MiB.
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    s.wait_for(&Seen::Gone { n: 0, step: 1 }).await;
}
