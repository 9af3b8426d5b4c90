//! The harness's model calls against a real `estop serve` and the scripted model server
//! (issue 28): no call starts after a cancel is acknowledged, failed calls back off (and a stop
//! does not wait the backoff out), and a tool call with invalid arguments is answered to the
//! model instead of being sent again in silence.

mod common;

use common::{Daemon, poll};
use estop_harness::budget::{Limits, Prices};
use estop_harness::gate::GateConfig;
use estop_harness::machine::State;
use estop_harness::model::ModelClient;
use estop_harness::record::{CallLimits, Exit};
use estop_harness::retry::Retry;
use estop_harness::runner::{Runner, RunnerOptions, Tool};
use estop_harness::scripted::{self, Script, Scripted, Seen, Step};
use estop_protocol::{Fields, Op, Verb};
use serde_json::json;
use std::time::{Duration, Instant};

const POLICY: &str = r#"
[defaults]
unknown_tool = "approve"
approval_expiry = "10m"

[[rules]]
tool = "lookup"
action = "allow"
class = "read"

[[rules]]
tool = "drop_table"
action = "approve"
reversibility = "irreversible"
"#;

fn op(verb: Verb, v: serde_json::Value) -> Op {
    let mut f = Fields::new();
    for (k, x) in v.as_object().unwrap() {
        f.json(k, x);
    }
    f.build(verb).unwrap().op
}

/// A runner's options: its own journal directory `name`, the scripted model at `model`.
fn options(d: &Daemon, name: &str, model: &str) -> RunnerOptions {
    let effects = d.data().join("effects");
    let append = |tag: &str| {
        vec![
            "sh".into(),
            "-c".into(),
            format!("echo {tag} >> {}; cat", effects.display()),
        ]
    };
    RunnerOptions {
        data: d.data().join(name),
        gate: GateConfig {
            target: d.socket(),
            token: d.token("agent.token"),
        },
        model: ModelClient::new(model, None).unwrap(),
        call_limits: CallLimits {
            model: "m".into(),
            max_output_tokens: 256,
            call_deadline_ms: 60_000,
            tool_deadline_ms: 60_000,
            retry: Retry::default(),
        },
        limits: Limits {
            turns_max: Some(10),
            ..Limits::default()
        },
        prices: Prices {
            input: 3.0,
            cached_input: 0.3,
            output: 15.0,
        },
        upstreams: Default::default(),
        subagents: None,
        workspaces: None,
        contract: None,
        sandbox: None,
        tools: vec![
            Tool {
                name: "lookup".into(),
                description: "read".into(),
                parameters: json!({"type": "object"}),
                command: append("lookup"),
                read_only: true,
                ..Tool::default()
            },
            Tool {
                name: "drop_table".into(),
                description: "drop".into(),
                parameters: json!({"type": "object"}),
                command: append("drop_table"),
                ..Tool::default()
            },
        ],
        system: "You are a careful agent.".into(),
        grace: Duration::from_millis(100),
        workers: 4,
        tpm: 1_000_000,
        rpm: 1_000,
        journal: Default::default(),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn model_server(rt: &tokio::runtime::Runtime, responses: Vec<Vec<Step>>) -> Scripted {
    rt.block_on(Scripted::start("127.0.0.1:0", Script { responses }))
        .unwrap()
}

/// Starts `id` on a runner of `opts` and runs it on `rt` until every trajectory ended.
fn spawn_run(
    rt: &tokio::runtime::Runtime,
    opts: RunnerOptions,
    id: &str,
) -> tokio::task::JoinHandle<Runner> {
    let mut runner = rt.block_on(async { Runner::open(opts) }).unwrap();
    rt.block_on(async { runner.start(id, None, "work") })
        .unwrap();
    rt.spawn(async move {
        runner.run().await.unwrap();
        runner
    })
}

/// Issue 28: a cancel while a call is held let one more model call start (4 of 18 tries,
/// 5–70 ms after the cancel was acknowledged): the gate's refusal of the held call reached the
/// runner before the stop's event did, and it planned again. The runner now reads the run's
/// fence at the gate right before every model call, so whatever order the refusal and the
/// stop arrive in, the scripted model sees no request after `estop cancel` returned and the
/// trajectory ends CANCELED. Run 24 times: the old runner failed it within a few.
#[test]
fn no_model_call_starts_after_a_cancel_of_a_held_call_is_acknowledged() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let rt = runtime();
    let mut operator = d.operator();
    for i in 0..24 {
        let id = format!("race-{i}");
        let server = model_server(
            &rt,
            vec![
                scripted::call("c1", "drop_table", "{\"table\": \"orders\"}"),
                scripted::answer("I went on after the cancel"),
            ],
        );
        let opts = options(&d, &format!("harness-{i}"), &server.base_url());
        let run = spawn_run(&rt, opts, &id);
        let held = poll(Duration::from_secs(20), Duration::from_millis(2), || {
            let p = operator.request(&op(Verb::Pending, json!({"run": id})));
            let held = p.is_ok_and(|p| format!("{p:?}").contains("c1"));
            (held, held)
        });
        assert!(held, "{id}: c1 never held");
        let (code, _, err) = d.cli(&["cancel", &id, "--reason", "operator stop"]);
        assert_eq!(code, 0, "{err}");
        let acknowledged = Instant::now();
        let runner = rt.block_on(run).unwrap();
        let rec = runner.record(&id).unwrap();
        let late: Vec<Duration> = server
            .call_times()
            .iter()
            .filter(|t| **t > acknowledged)
            .map(|t| *t - acknowledged)
            .collect();
        assert!(
            late.is_empty(),
            "{id}: model calls started after the cancel was acknowledged: {late:?}"
        );
        assert_eq!(server.calls().len(), 1, "{id}");
        assert_eq!(rec.state, State::Canceled, "{id}: {:?}", rec.exit);
    }
}

/// The retry lines of `id` in the journal of `dir`: (attempt, delay in ms), in order.
fn retries(dir: &std::path::Path, id: &str) -> Vec<(u32, u64)> {
    let journal = estop_harness::journal::read_only(&dir.join("journal"), 64 << 20).unwrap();
    journal
        .logs
        .iter()
        .filter(|(t, _)| t == id)
        .filter_map(|(_, line)| {
            let rest = line.strip_prefix("retry ")?;
            let (n, rest) = rest.split_once(" of the model call in ")?;
            let (ms, _) = rest.split_once(" ms")?;
            Some((n.parse().ok()?, ms.parse().ok()?))
        })
        .collect()
}

/// Issue 28: twelve 500s in a row were retried within 43 ms. Now 500 ×5 then an answer: each
/// retry waits its journalled delay (full jitter under a ceiling doubling from 40 ms), the
/// gaps the scripted server sees are at least those delays, and the ceilings grow; the 6th
/// call completes the trajectory.
#[test]
fn failed_model_calls_back_off_exponentially_with_each_retry_journalled() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let rt = runtime();
    let mut responses: Vec<Vec<Step>> = (0..5).map(|_| scripted::status(500, &[])).collect();
    responses.push(scripted::answer("done"));
    let server = model_server(&rt, responses);
    let mut opts = options(&d, "harness", &server.base_url());
    let policy = Retry {
        base_ms: 40,
        cap_ms: 5_000,
        retries_max: 8,
        retry_after_max_ms: 5_000,
    };
    opts.call_limits.retry = policy;
    let dir = opts.data.clone();
    let runner = rt.block_on(spawn_run(&rt, opts, "backoff-1")).unwrap();
    let rec = runner.record("backoff-1").unwrap();
    assert_eq!(rec.state, State::Completed, "{:?}", rec.exit);
    assert_eq!(rec.backoff, None);
    drop(runner);
    let times = server.call_times();
    assert_eq!(times.len(), 6);
    let logged = retries(&dir, "backoff-1");
    assert_eq!(
        logged.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        [1, 2, 3, 4, 5],
        "each retry journalled: {logged:?}"
    );
    for (k, (n, delay)) in logged.iter().enumerate() {
        let ceiling = policy.ceiling_ms(*n);
        assert!(*delay <= ceiling, "retry {n}: {delay} ms over {ceiling}");
        let gap = times[k + 1] - times[k];
        assert!(
            gap >= Duration::from_millis(*delay),
            "retry {n} came after {gap:?}, before its {delay} ms"
        );
    }
    let ceilings: Vec<u64> = (1..=5).map(|n| policy.ceiling_ms(n)).collect();
    assert_eq!(ceilings, [40, 80, 160, 320, 640], "the gaps' ceilings grow");
    // The whole wait is the sum of the drawn delays (the old runner's six calls took ~20 ms).
    let total: u64 = logged.iter().map(|(_, d)| d).sum();
    assert!(times[5] - times[0] >= Duration::from_millis(total));
}

/// A 429 with `Retry-After: 1` is retried no sooner than a second later (the jitter alone
/// would be at most 40 ms here).
#[test]
fn a_429_with_retry_after_waits_at_least_that_long() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let rt = runtime();
    let server = model_server(
        &rt,
        vec![
            scripted::status(429, &[("Retry-After", "1")]),
            scripted::answer("done"),
        ],
    );
    let mut opts = options(&d, "harness", &server.base_url());
    opts.call_limits.retry.base_ms = 40;
    let runner = rt.block_on(spawn_run(&rt, opts, "after-1")).unwrap();
    assert_eq!(runner.record("after-1").unwrap().state, State::Completed);
    let times = server.call_times();
    assert_eq!(times.len(), 2);
    assert!(
        times[1] - times[0] >= Duration::from_secs(1),
        "{:?}",
        times[1] - times[0]
    );
}

/// A cancel during a backoff (a 503 asking for 30 s) ends the trajectory at once, CANCELED,
/// with no further model call: the wait is no turn, and READY is a boundary.
#[test]
fn a_cancel_during_a_backoff_ends_the_trajectory_at_once() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let rt = runtime();
    let server = model_server(
        &rt,
        vec![
            // The run exists at the gate once a call was admitted.
            scripted::call("c1", "lookup", "{\"q\": 1}"),
            scripted::status(503, &[("Retry-After", "30")]),
            scripted::answer("done"),
        ],
    );
    let opts = options(&d, "harness", &server.base_url());
    let dir = opts.data.clone();
    let run = spawn_run(&rt, opts, "wait-1");
    rt.block_on(server.wait_for(&Seen::Served { n: 1 }));
    // The backoff is journalled before the runner waits.
    let journalled = poll(Duration::from_secs(10), Duration::from_millis(5), || {
        let r = retries(&dir, "wait-1");
        (!r.is_empty(), r)
    });
    assert_eq!(journalled.len(), 1, "{journalled:?}");
    assert!(journalled[0].1 >= 30_000, "{journalled:?}");
    // `estop agent status` shows the wait (the record's backoff).
    let (code, out, err) = d.cli(&[
        "agent",
        "status",
        "wait-1",
        "--journal",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("backoff retry=1 delay_ms=30000 ") && l.contains("HTTP 503")),
        "{out}"
    );
    let (code, _, err) = d.cli(&["cancel", "wait-1", "--reason", "operator stop"]);
    assert_eq!(code, 0, "{err}");
    let cancelled = Instant::now();
    let runner = rt.block_on(run).unwrap();
    assert!(
        cancelled.elapsed() < Duration::from_secs(5),
        "{:?}",
        cancelled.elapsed()
    );
    let rec = runner.record("wait-1").unwrap();
    assert_eq!(rec.state, State::Canceled, "{:?}", rec.exit);
    assert!(matches!(rec.exit, Some(Exit::Canceled { .. })));
    assert_eq!(server.calls().len(), 2, "no call after the cancel");
}

/// Issue 28: a tool call whose arguments were not JSON was dropped and the identical request
/// sent again. Now the model's next request holds the answer — role `tool`, the same
/// `tool_call_id`, `INVALID_ARGUMENTS` naming the problem — and nothing was admitted at the
/// gate (no run was created) or run.
#[test]
fn invalid_tool_call_arguments_are_answered_to_the_model_as_a_tool_error() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let rt = runtime();
    let server = model_server(
        &rt,
        vec![
            scripted::call("c1", "lookup", "{\"q\": "),
            scripted::answer("fixed"),
        ],
    );
    let opts = options(&d, "harness", &server.base_url());
    let runner = rt.block_on(spawn_run(&rt, opts, "args-1")).unwrap();
    assert_eq!(runner.record("args-1").unwrap().state, State::Completed);
    let calls = server.calls();
    assert_eq!(calls.len(), 2);
    let messages = calls[1]["messages"].as_array().unwrap();
    let answer = messages
        .iter()
        .find(|m| m["role"] == "tool" && m["tool_call_id"] == "c1")
        .unwrap_or_else(|| panic!("no tool message for c1 in {messages:?}"));
    let body: serde_json::Value =
        serde_json::from_str(answer["content"].as_str().unwrap()).unwrap();
    assert_eq!(body["status"], "REFUSED");
    assert_eq!(body["reason"], "INVALID_ARGUMENTS");
    assert!(
        body["message"].as_str().unwrap().contains("not valid JSON"),
        "{body}"
    );
    assert!(!d.data().join("effects").exists(), "nothing ran");
    // Nothing admitted: the run was never created, or (its close) holds no effect.
    match d
        .operator()
        .request(&op(Verb::Status, json!({"run": "args-1"})))
    {
        Ok(estop_protocol::ReplyBody::Status(v)) => {
            assert_eq!(v.effects, Default::default(), "{v:?}")
        }
        Ok(other) => panic!("{other:?}"),
        Err(e) => assert_eq!(e.code(), Some(estop_protocol::ErrorCode::NotFound), "{e}"),
    }
}

/// The fence is read or no call starts: with the gate unreachable (its socket gone) the runner
/// does not guess that the run is open. Each turn backs off as a failed call does, naming the
/// fence, and after `retries_max` the trajectory ends FAILED; the model never saw a request.
#[test]
fn no_model_call_starts_while_the_fence_cannot_be_read() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let rt = runtime();
    let server = model_server(&rt, vec![scripted::answer("should not be asked")]);
    let mut opts = options(&d, "harness", &server.base_url());
    opts.gate.target = d.data().join("no-such.sock").display().to_string();
    opts.call_limits.retry = Retry {
        base_ms: 5,
        cap_ms: 20,
        retries_max: 2,
        retry_after_max_ms: 20,
    };
    let dir = opts.data.clone();
    let runner = rt.block_on(spawn_run(&rt, opts, "blind-1")).unwrap();
    let rec = runner.record("blind-1").unwrap();
    assert_eq!(rec.state, State::Failed);
    assert!(
        matches!(&rec.exit, Some(Exit::Error { error }) if error.contains("3 failures in a row") && error.contains("the run's fence")),
        "{:?}",
        rec.exit
    );
    drop(runner);
    assert!(server.calls().is_empty(), "no model call on a guess");
    assert_eq!(
        retries(&dir, "blind-1")
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>(),
        [1, 2]
    );
}
