//! The gateway's streamable HTTP front, end to end and hostile first: a real daemon, the gateway
//! on a loopback port in this process, raw HTTP requests (a client that misbehaves) and rmcp's
//! streamable HTTP client (one that does not), the rmcp fixture upstream behind. Every refusal
//! is checked against the upstream's log: nothing refused ever reaches the tool.

mod common;

use common::web::*;
use common::*;
use rmcp::ServiceExt;
use rmcp::model::{CallToolRequestParams, ProtocolVersion};
use rmcp::service::{ClientLifecycleMode, ClientServiceExt, RoleClient, RunningService};
use rmcp::transport::streamable_http_client::{
    StreamableHttpClientTransport, StreamableHttpClientTransportConfig,
};
use serde_json::{Value, json};
use std::time::Duration;

fn tools_call(tool: &str, text: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": tool, "arguments": {"text": text}}})
}

/// Opens a 2025-06-18 session as `token`: its id.
async fn open_session(addr: &str, token: &str) -> String {
    let bearer = format!("Bearer {token}");
    let r = post(addr, &[("authorization", &bearer)], &initialize()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let id = r.headers["mcp-session-id"].to_str().unwrap().to_string();
    let done = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let h = [("authorization", bearer.as_str()), ("mcp-session-id", &id)];
    assert_eq!(post(addr, &h, &done).await.status, 202);
    id
}

async fn http_client(addr: &str, token: &str) -> RunningService<RoleClient, ()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let config = StreamableHttpClientTransportConfig::with_uri(format!("http://{addr}/mcp"))
        .auth_header(token);
    ().serve(StreamableHttpClientTransport::from_config(config))
        .await
        .expect("the gateway initializes over HTTP")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_agent_credential_nothing_is_served() {
    let w = world();
    let addr = http_gateway(&w, "auth", "").await;
    let operator = std::fs::read_to_string(w.data.join("operator.token")).unwrap();
    let operator = format!("Bearer {}", operator.trim());
    for (headers, status, says) in [
        (vec![], 401, "estop agent token"),
        (
            vec![("authorization", "Bearer not-a-token")],
            401,
            "refused",
        ),
        (vec![("authorization", "Basic YWdlbnQ6eA==")], 401, "Bearer"),
        (
            vec![("authorization", operator.as_str())],
            403,
            "agent token",
        ),
    ] {
        let r = post(&addr, &headers, &initialize()).await;
        assert_eq!(r.status, status, "{headers:?}: {}", r.body);
        assert!(r.body.contains(says), "{headers:?}: {}", r.body);
        assert!(r.headers.get("mcp-session-id").is_none(), "{headers:?}");
        if status == 401 {
            assert_eq!(r.headers["www-authenticate"], "Bearer");
        }
        let r = post(&addr, &headers, &tools_call("files__echo", "x")).await;
        assert_eq!(r.status, status, "{headers:?}: {}", r.body);
    }
    assert!(w.upstream().is_empty(), "{:?}", w.upstream());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_origin_or_host_is_refused_even_with_a_credential() {
    let w = world();
    let addr = http_gateway(
        &w,
        "origin",
        "[http]\nallowed_origins = [\"http://localhost:3000\"]",
    )
    .await;
    let agent = std::fs::read_to_string(w.data.join("agent.token")).unwrap();
    let bearer = format!("Bearer {}", agent.trim());
    let port = addr.rsplit(':').next().unwrap();
    let rebound = format!("evil.example:{port}");
    for (extra, status) in [
        (("origin", "http://evil.example"), 403),
        (("origin", "http://localhost:3001"), 403),
        (("origin", "null"), 403),
        // DNS rebinding: a hostile name that resolves to 127.0.0.1 carries its own Host.
        (("host", rebound.as_str()), 403),
        (("origin", "http://localhost:3000"), 200),
    ] {
        let r = post(&addr, &[("authorization", &bearer), extra], &initialize()).await;
        assert_eq!(r.status, status, "{extra:?}: {}", r.body);
    }
    // With no `allowed_origins`, every request that carries an Origin is a browser's: refused.
    let addr = http_gateway(&w, "origin2", "").await;
    let h = [
        ("authorization", bearer.as_str()),
        ("origin", "http://localhost:3000"),
    ];
    assert_eq!(post(&addr, &h, &initialize()).await.status, 403);
    assert!(w.upstream().is_empty(), "{:?}", w.upstream());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_is_its_principals_alone() {
    let w = world();
    let addr = http_gateway(&w, "sessions", "").await;
    let alice = agent_token(&w, "alice");
    let bob = agent_token(&w, "bob");
    let session = open_session(&addr, &alice).await;
    let a = format!("Bearer {alice}");
    let b = format!("Bearer {bob}");
    let r = post(
        &addr,
        &[("authorization", &a), ("mcp-session-id", &session)],
        &tools_call("files__echo", "alice"),
    )
    .await;
    assert_eq!(
        r.message()["result"]["content"][0]["text"],
        "echo: alice",
        "{}",
        r.body
    );
    // Bob holds a valid token and Alice's session id: her session is not found for him.
    let r = post(
        &addr,
        &[("authorization", &b), ("mcp-session-id", &session)],
        &tools_call("files__echo", "bob"),
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.body);
    let closed = http()
        .delete(format!("http://{addr}/mcp"))
        .header("authorization", &b)
        .header("mcp-session-id", &session)
        .send()
        .await
        .unwrap();
    assert_eq!(
        closed.status().as_u16(),
        404,
        "Bob cannot close Alice's session"
    );
    let r = post(
        &addr,
        &[("authorization", &a), ("mcp-session-id", &session)],
        &tools_call("files__echo", "again"),
    )
    .await;
    assert_eq!(
        r.message()["result"]["content"][0]["text"],
        "echo: again",
        "{}",
        r.body
    );
    assert_eq!(w.upstream(), ["call echo alice", "call echo again"]);
}

/// 2026-07-28 requests name their method (and tool) in `Mcp-Method` / `Mcp-Name` headers too;
/// a header that says something other than the body is refused before anything runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_that_contradict_the_body_are_refused() {
    let w = world();
    let addr = http_gateway(&w, "headers", "").await;
    let agent = std::fs::read_to_string(w.data.join("agent.token")).unwrap();
    let bearer = format!("Bearer {}", agent.trim());
    let mut call = tools_call("files__echo", "stateless");
    call["params"]["_meta"] = json!({
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "1"}});
    let base = [
        ("authorization", bearer.as_str()),
        ("mcp-protocol-version", "2026-07-28"),
    ];
    for (method, name, says) in [
        (
            Some("tools/list"),
            Some("files__echo"),
            "does not match body method",
        ),
        (
            Some("tools/call"),
            Some("files__peek"),
            "does not match body value",
        ),
        (Some("tools/call"), None, "missing required Mcp-Name"),
        (None, Some("files__echo"), "missing required Mcp-Method"),
    ] {
        let mut h = base.to_vec();
        h.extend(method.map(|m| ("mcp-method", m)));
        h.extend(name.map(|n| ("mcp-name", n)));
        let r = post(&addr, &h, &call).await;
        assert_eq!(r.status, 400, "{h:?}: {}", r.body);
        assert!(r.body.contains(says), "{h:?}: {}", r.body);
    }
    // A supplied Mcp-Method that contradicts an older revision's body is refused as well.
    let h = [
        ("authorization", bearer.as_str()),
        ("mcp-method", "tools/list"),
    ];
    let r = post(&addr, &h, &initialize()).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(w.upstream().is_empty(), "{:?}", w.upstream());
    let mut h = base.to_vec();
    h.extend([("mcp-method", "tools/call"), ("mcp-name", "files__echo")]);
    let r = post(&addr, &h, &call).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.message()["result"]["content"][0]["text"],
        "echo: stateless",
        "{}",
        r.body
    );
    assert_eq!(w.upstream(), ["call echo stateless"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_and_sessions_are_bounded() {
    let w = world();
    let addr = http_gateway(
        &w,
        "bounds",
        "[http]\nbody_bytes_max = 4096\nsessions_max = 2",
    )
    .await;
    let agent = std::fs::read_to_string(w.data.join("agent.token")).unwrap();
    let bearer = format!("Bearer {}", agent.trim());
    let big = tools_call("files__echo", &"x".repeat(8192));
    let r = post(&addr, &[("authorization", &bearer)], &big).await;
    assert_eq!(r.status, 413, "{}", r.body);
    open_session(&addr, agent.trim()).await;
    open_session(&addr, agent.trim()).await;
    let r = post(&addr, &[("authorization", &bearer)], &initialize()).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.body.contains("sessions_max"), "{}", r.body);
    assert!(w.upstream().is_empty(), "{:?}", w.upstream());
}

/// rmcp's own streamable HTTP client: gated exactly like stdio, each session its own run (so a
/// second session's same call is a new effect), the 2026-07-28 revision by `server/discover`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rmcp_client_over_http_is_gated_in_its_sessions_run() {
    let w = world();
    let addr = http_gateway(&w, "rmcp", "").await;
    let agent = std::fs::read_to_string(w.data.join("agent.token")).unwrap();
    let c = http_client(&addr, agent.trim()).await;
    let names: Vec<String> = c
        .peer()
        .list_all_tools()
        .await
        .unwrap()
        .iter()
        .map(|t| t.name.to_string())
        .collect();
    assert!(names.contains(&"files__echo".to_string()), "{names:?}");
    assert_eq!(text(&call(&c, "files__echo", "one").await), "echo: one");
    assert_eq!(text(&call(&c, "files__echo", "one").await), "echo: one");
    let denied = call(&c, "files__write", "rm -rf /").await;
    assert!(
        text(&denied).starts_with("REFUSED, not run: denied"),
        "{}",
        text(&denied)
    );
    assert_eq!(
        w.upstream(),
        ["call echo one"],
        "replayed within the session"
    );
    let c2 = http_client(&addr, agent.trim()).await;
    assert_eq!(text(&call(&c2, "files__echo", "one").await), "echo: one");
    assert_eq!(
        w.upstream(),
        ["call echo one", "call echo one"],
        "another session, another run"
    );
    let runs = w.operator(json!({"op": "runs"}));
    let mcp_runs = runs["runs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["run"].as_str().unwrap().starts_with("mcp-"))
        .count();
    assert_eq!(mcp_runs, 2, "{runs}");

    let mode = ClientLifecycleMode::Discover {
        preferred_versions: vec![ProtocolVersion::V_2026_07_28],
    };
    let config = StreamableHttpClientTransportConfig::with_uri(format!("http://{addr}/mcp"))
        .auth_header(agent.trim());
    let c3 =
        ().serve_with_lifecycle(StreamableHttpClientTransport::from_config(config), mode)
            .await
            .expect("discovered over HTTP");
    let agreed = c3.peer().peer_info().map(|i| i.protocol_version.clone());
    assert_eq!(agreed, Some(ProtocolVersion::V_2026_07_28));
    assert_eq!(text(&call(&c3, "files__echo", "2026").await), "echo: 2026");
    // Session-less, its calls are in the principal's run of this gateway: a repeat replays.
    assert_eq!(text(&call(&c3, "files__echo", "2026").await), "echo: 2026");
    let mut p = CallToolRequestParams::new("files__write");
    let Value::Object(args) = json!({"text": "no"}) else {
        unreachable!()
    };
    p.arguments = Some(args);
    let r = c3.peer().call_tool(p).await.unwrap();
    assert!(
        text(&r).starts_with("REFUSED, not run: denied"),
        "{}",
        text(&r)
    );
    let calls = w.upstream();
    assert_eq!(
        calls.iter().filter(|l| *l == "call echo 2026").count(),
        1,
        "{calls:?}"
    );
}

/// The operator's `[runs] header` names the run: two sessions sending the same run share it
/// (the second's same call is a replay), and the run is the one named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_header_names_the_run_across_sessions() {
    let w = world();
    let addr = http_gateway(&w, "hdr", "[runs]\nheader = \"Estop-Run\"").await;
    let agent = std::fs::read_to_string(w.data.join("agent.token")).unwrap();
    let with_run = |run: &'static str| {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let headers = [(
            http::HeaderName::from_static("estop-run"),
            http::HeaderValue::from_static(run),
        )];
        StreamableHttpClientTransportConfig::with_uri(format!("http://{addr}/mcp"))
            .auth_header(agent.trim())
            .custom_headers(headers.into_iter().collect())
    };
    let c1 = ()
        .serve(StreamableHttpClientTransport::from_config(with_run(
            "shared-run",
        )))
        .await
        .unwrap();
    let c2 = ()
        .serve(StreamableHttpClientTransport::from_config(with_run(
            "shared-run",
        )))
        .await
        .unwrap();
    assert_eq!(text(&call(&c1, "files__echo", "x").await), "echo: x");
    assert_eq!(text(&call(&c2, "files__echo", "x").await), "echo: x");
    assert_eq!(
        w.upstream(),
        ["call echo x"],
        "one run: the second is a replay"
    );
    let report = w.operator(json!({"op": "report", "run": "shared-run"}));
    assert_eq!(report["done"][0]["tool"], "files__echo", "{report}");
}

/// A revoked token stops working at once, though its principal was met before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_token_is_refused_at_once() {
    let w = world();
    let addr = http_gateway(&w, "revoke", "").await;
    let carol = agent_token(&w, "carol");
    open_session(&addr, &carol).await;
    let v = w.operator(json!({"op": "token_revoke", "name": "carol"}));
    assert_eq!(v["ok"], true, "{v}");
    let bearer = format!("Bearer {carol}");
    // The daemon closes carol's connection; the gateway learns it from the closed stream.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let r = post(&addr, &[("authorization", &bearer)], &initialize()).await;
        if r.status == 401 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still served: {}",
            r.status
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(w.upstream().is_empty());
}

/// A held call's task (SEP-2663) over HTTP is its principal's alone: another principal with
/// the task's id can neither read nor cancel it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_is_its_principals_alone() {
    use rmcp::model::{
        CallToolResponse, CancelTaskParams, ClientCapabilities, ClientConfig, GetTaskParams,
        Implementation,
    };
    let w = world();
    let addr = http_gateway(&w, "tasks", "").await;
    let client = |token: String| {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let caps = ClientCapabilities::builder().enable_tasks().build();
        let config = StreamableHttpClientTransportConfig::with_uri(format!("http://{addr}/mcp"))
            .auth_header(token);
        async move {
            ClientConfig::new(caps, Implementation::new("tasks", "1"))
                .serve(StreamableHttpClientTransport::from_config(config))
                .await
                .unwrap()
        }
    };
    let alice = client(agent_token(&w, "alice")).await;
    let bob = client(agent_token(&w, "bob")).await;
    let mut p = CallToolRequestParams::new("files__write");
    let Value::Object(args) = json!({"text": "hold-mine"}) else {
        unreachable!()
    };
    p.arguments = Some(args);
    let CallToolResponse::Task(t) = alice.peer().call_tool_once(p).await.unwrap() else {
        panic!("not a task")
    };
    let id = t.task.task_id;
    assert!(alice.peer().get_task(GetTaskParams::new(&id)).await.is_ok());
    assert!(bob.peer().get_task(GetTaskParams::new(&id)).await.is_err());
    assert!(
        bob.peer()
            .cancel_task(CancelTaskParams::new(&id))
            .await
            .is_err()
    );
    let got = alice
        .peer()
        .get_task(GetTaskParams::new(&id))
        .await
        .unwrap();
    assert_eq!(
        got.task.task.status,
        rmcp::model::TaskStatus::Working,
        "Bob's cancel did nothing"
    );
}

/// 2025-11-25's own task form over HTTP (`params.task`, tests/tasks_2025.rs on stdio): a
/// task is its principal's alone. Another principal with its id gets "no task" from
/// `tasks/get`, `tasks/result` and `tasks/cancel`, and does not see it in `tasks/list`; the
/// owner's task is still held, nothing ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_2025_11_25_task_is_its_principals_alone() {
    let w = world();
    let addr = http_gateway(&w, "tasks25", "").await;
    let alice = Session25::open(&addr, &agent_token(&w, "alice25")).await;
    let bob = Session25::open(&addr, &agent_token(&w, "bob25")).await;
    let tools = alice.send("tools/list", json!({})).await;
    assert_eq!(
        tools["result"]["tools"][0]["execution"]["taskSupport"], "optional",
        "{tools}"
    );
    let created = alice
        .send(
            "tools/call",
            json!({"name": "files__write", "arguments": {"text": "hold-a25"}, "task": {}}),
        )
        .await;
    let id = created["result"]["task"]["taskId"]
        .as_str()
        .unwrap_or_else(|| panic!("not a task: {created}"))
        .to_string();
    for method in ["tasks/get", "tasks/result", "tasks/cancel"] {
        let v = bob.send(method, json!({"taskId": id})).await;
        assert_eq!(v["error"]["code"], -32602, "{method}: {v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("no task"),
            "{v}"
        );
    }
    let listed = bob.send("tasks/list", json!({})).await;
    assert_eq!(listed["result"]["tasks"], json!([]), "{listed}");
    let mine = alice.send("tasks/get", json!({"taskId": id})).await;
    assert_eq!(
        mine["result"]["status"], "working",
        "Bob's cancel did nothing: {mine}"
    );
    let listed = alice.send("tasks/list", json!({})).await;
    assert_eq!(
        listed["result"]["tasks"][0]["taskId"],
        json!(id),
        "{listed}"
    );
    assert!(w.upstream().is_empty(), "{:?}", w.upstream());
}

/// 2026-07-28's `subscriptions/listen` over HTTP (no session: the stream is one long POST):
/// the stream hears a resource update of its URI and a tool list change, and the upstream is
/// unsubscribed once it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_2026_07_28_listen_stream_over_http() {
    use rmcp::model::{ReadResourceRequestParams, ServerNotification, SubscriptionFilter};
    let w = world();
    let addr = http_gateway(&w, "listen", "").await;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mode = ClientLifecycleMode::Discover {
        preferred_versions: vec![ProtocolVersion::V_2026_07_28],
    };
    let config = StreamableHttpClientTransportConfig::with_uri(format!("http://{addr}/mcp"))
        .auth_header(agent_token(&w, "listener"));
    let c =
        ().serve_with_lifecycle(StreamableHttpClientTransport::from_config(config), mode)
            .await
            .expect("discovered over HTTP");
    c.peer().list_all_resources().await.unwrap();
    let asked = SubscriptionFilter::builder()
        .tools_list_changed()
        .resource_subscriptions(["fixture://notes"])
        .build();
    let mut stream = c.peer().listen(asked).await.expect("acknowledged");
    w.upstream_logged("subscribe fixture://notes").await;
    let mut next = async || {
        tokio::time::timeout(Duration::from_secs(30), stream.next())
            .await
            .expect("told in time")
            .unwrap()
            .expect("the stream is open")
    };
    c.peer()
        .read_resource(ReadResourceRequestParams::new("fixture://touch"))
        .await
        .unwrap();
    let note = next().await;
    assert!(
        matches!(&note, ServerNotification::ResourceUpdatedNotification(n) if n.params.uri == "fixture://notes"),
        "only what was accepted: {note:?}"
    );
    call(&c, "files__mutate", "x").await;
    let note = next().await;
    assert!(
        matches!(note, ServerNotification::ToolListChangedNotification(_)),
        "{note:?}"
    );
    drop(stream);
    w.upstream_logged("unsubscribe fixture://notes").await;
}

/// `DELETE` of a session is answered 204 (rmcp says 202, which the spec does not list for it)
/// and ends the session: a request naming its id afterwards is 404, as the spec says, and a
/// second `DELETE` finds nothing either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_ends_a_session_with_204_and_its_id_is_404_afterwards() {
    let w = world();
    let addr = http_gateway(&w, "delete", "").await;
    let agent = agent_token(&w, "deleter");
    let session = open_session(&addr, &agent).await;
    let bearer = format!("Bearer {agent}");
    let h = [
        ("authorization", bearer.as_str()),
        ("mcp-session-id", session.as_str()),
    ];
    let r = post(&addr, &h, &tools_call("files__echo", "before")).await;
    assert_eq!(r.message()["result"]["content"][0]["text"], "echo: before");
    let delete = || {
        http()
            .delete(format!("http://{addr}/mcp"))
            .header("authorization", &bearer)
            .header("mcp-session-id", &session)
            .header("mcp-protocol-version", "2025-06-18")
            .send()
    };
    let closed = delete().await.unwrap();
    assert_eq!(closed.status().as_u16(), 204, "{:?}", closed.text().await);
    let r = post(&addr, &h, &tools_call("files__echo", "after")).await;
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(delete().await.unwrap().status().as_u16(), 404);
    assert_eq!(w.upstream(), ["call echo before"]);
}
