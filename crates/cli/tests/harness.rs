//! The harness (`estop-harness`) end to end: a real `estop serve` admits every tool call of a
//! trajectory the runner drives against the scripted model server.

mod common;

use common::Daemon;
use estop_harness::budget::{Limits, Prices};
use estop_harness::gate::GateConfig;
use estop_harness::machine::State;
use estop_harness::model::ModelClient;
use estop_harness::record::{CallLimits, Control, Exit};
use estop_harness::runner::Input;
use estop_harness::runner::{Runner, RunnerOptions, Tool};
use estop_harness::scripted::{self, Script, Scripted, Seen, Step};
use estop_harness::subagent::Subagents;
use estop_protocol::{EventKind, Fields, Op, Verb};
use serde_json::json;
use std::time::Duration;

const POLICY: &str = r#"
[defaults]
unknown_tool = "approve"
approval_expiry = "10m"

[[rules]]
tool = "lookup"
action = "allow"
class = "read"

[[rules]]
tool = "fetch"
action = "allow"

[[rules]]
tool = "drop_table"
action = "approve"
reversibility = "irreversible"

[[rules]]
tool = "delegate"
action = "allow"
"#;

fn op(verb: Verb, v: serde_json::Value) -> Op {
    let mut f = Fields::new();
    for (k, x) in v.as_object().unwrap() {
        f.json(k, x);
    }
    f.build(verb).unwrap().op
}

fn options(d: &Daemon, model: &str, effects: &std::path::Path) -> RunnerOptions {
    let append = |tag: &str| {
        vec![
            "sh".into(),
            "-c".into(),
            format!("echo {tag} >> {}; cat", effects.display()),
        ]
    };
    RunnerOptions {
        data: d.data().join("harness"),
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
            retry: Default::default(),
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

/// A read runs at once; an irreversible call is held at the gate, rejected by an operator, and
/// the model sees a structured refusal instead — the call never ran. The model then answers
/// and the trajectory completes; the gate's run is closed.
#[test]
fn a_rejected_call_never_runs_and_the_model_sees_the_refusal() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let effects = d.data().join("effects");
    let rt = runtime();
    let server = model_server(
        &rt,
        vec![
            scripted::call("c1", "lookup", "{\"q\": \"orders\"}"),
            scripted::call(
                "c2",
                "drop_table",
                "{\"db\": \"prod\", \"table\": \"orders_staging\"}",
            ),
            scripted::answer("left the table in place"),
        ],
    );
    let mut runner = rt
        .block_on(async { Runner::open(options(&d, &server.base_url(), &effects)) })
        .unwrap();
    rt.block_on(async { runner.start("traj-1", None, "clean up staging") })
        .unwrap();
    let run = rt.spawn(async move {
        runner.run().await.unwrap();
        runner
    });
    // The run exists once the lookup was admitted (before the second model call).
    rt.block_on(server.wait_for(&Seen::Call { n: 1 }));
    let mut op_client = d.operator();
    op_client
        .request(&op(Verb::Subscribe, json!({"run": "traj-1"})))
        .unwrap();
    let held_now = |c: &mut estop_server::client::Client| {
        let p = c
            .request(&op(Verb::Pending, json!({"run": "traj-1"})))
            .unwrap();
        format!("{p:?}").contains("c2")
    };
    if !held_now(&mut op_client) {
        loop {
            let e = op_client.next_event().unwrap();
            if e.is_some_and(|e| e.event == EventKind::Held) {
                break;
            }
        }
    }
    let (code, _, err) = d.cli(&["reject", "traj-1", "c2", "--reason", "not in prod"]);
    assert_eq!(code, 0, "{err}");
    let runner = rt.block_on(run).unwrap();

    let rec = runner.record("traj-1").unwrap();
    assert_eq!(rec.state, State::Completed);
    assert_eq!(rec.exit, Some(Exit::Completed { check_passed: true }));
    assert_eq!(
        std::fs::read_to_string(&effects).unwrap(),
        "lookup\n",
        "drop_table never ran"
    );
    let calls = server.calls();
    assert_eq!(calls.len(), 3);
    let last = calls[2]["messages"].as_array().unwrap();
    let refusal = last
        .iter()
        .find(|m| m["tool_call_id"] == "c2")
        .expect("an observation for c2");
    let body: serde_json::Value =
        serde_json::from_str(refusal["content"].as_str().unwrap()).unwrap();
    assert_eq!(body["status"], "REFUSED");
    assert_eq!(body["reason"], "APPROVAL_DENIED");
    let lookup = last.iter().find(|m| m["tool_call_id"] == "c1").unwrap();
    assert_eq!(lookup["content"], "{\"q\": \"orders\"}");
    let (code, out, _) = d.cli(&["status", "traj-1", "--json"]);
    assert_eq!(code, 0);
    assert!(out.contains("completed"), "{out}");
}

/// `estop cancel` of the run while the model is streaming: the stream is cut (the server sees
/// the client go), the trajectory ends CANCELED through FINALIZING, and no other call is made.
#[test]
fn a_cancel_at_the_gate_cuts_the_open_stream_and_ends_the_trajectory() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let effects = d.data().join("effects");
    let rt = runtime();
    let server = model_server(
        &rt,
        vec![
            scripted::call("c1", "lookup", "{}"),
            vec![
                scripted::text("I will now drop"),
                Step::Gate,
                scripted::finish("stop"),
                Step::Done,
            ],
        ],
    );
    let mut opts = options(&d, &server.base_url(), &effects);
    // Without the cut, the call would end only at its deadline (and the test would fail).
    opts.call_limits.call_deadline_ms = 5_000;
    let mut runner = rt.block_on(async { Runner::open(opts) }).unwrap();
    rt.block_on(async { runner.start("traj-2", None, "work") })
        .unwrap();
    let run = rt.spawn(async move {
        runner.run().await.unwrap();
        runner
    });
    rt.block_on(server.wait_for(&Seen::Call { n: 1 }));
    let (code, _, err) = d.cli(&["cancel", "traj-2", "--reason", "operator stop"]);
    assert_eq!(code, 0, "{err}");
    let runner = rt.block_on(run).unwrap();
    let rec = runner.record("traj-2").unwrap();
    assert_eq!(rec.state, State::Canceled);
    assert!(
        matches!(&rec.exit, Some(Exit::Canceled { .. })),
        "{:?}",
        rec.exit
    );
    rt.block_on(server.wait_for(&Seen::Gone { n: 1, step: 1 }));
    assert_eq!(server.calls().len(), 2, "no call after the cancel");
    assert!(
        rec.budget.spend.turns == 2 && rec.budget.reserved.is_none(),
        "the cut call is settled"
    );
    let marker = runner
        .context("traj-2")
        .iter()
        .filter_map(|m| m.content.as_deref())
        .any(|c| c.starts_with("[interrupted"));
    assert!(marker, "the model-visible marker of the cut reply");
}

/// The harness dies while a tool call runs (its effect started at the gate, its result never
/// came back). A new runner on the same journal resumes the trajectory: the call is asked about
/// by its key, found started and never completed, and observed as UNKNOWN — it is not run
/// again — and the trajectory goes on to complete.
#[test]
fn a_crash_mid_tool_resumes_from_the_journal_without_running_the_call_again() {
    crash_mid_tool(estop_harness::journal::JournalOptions::default());
}

/// The same with the journal compacted after every write (`compact_bytes = 1`): the runner
/// that resumes reads the trajectory from a snapshot, and still does not run the call again.
#[test]
fn a_crash_mid_tool_after_compactions_resumes_from_the_snapshot_without_running_the_call_again() {
    crash_mid_tool(estop_harness::journal::JournalOptions {
        compact_bytes: 1,
        ..Default::default()
    });
}

fn crash_mid_tool(journal: estop_harness::journal::JournalOptions) {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let effects = d.data().join("effects");
    let (fifo_out, fifo_in) = (d.data().join("out"), d.data().join("in"));
    for f in [&fifo_out, &fifo_in] {
        assert!(
            std::process::Command::new("mkfifo")
                .arg(f)
                .status()
                .unwrap()
                .success()
        );
    }
    let script = Script {
        responses: vec![
            scripted::call("c1", "lookup", "{}"),
            scripted::answer("the lookup's outcome is unknown; stopping here"),
        ],
    };
    // The model server outlives the harness's crash: it runs on a runtime of its own.
    let server_rt = runtime();
    let server = model_server(&server_rt, script.responses);
    let rt = runtime();
    let mut opts = options(&d, &server.base_url(), &effects);
    opts.journal = journal;
    opts.tools[0].command = vec![
        "sh".into(),
        "-c".into(),
        format!(
            "echo started >> {e}; echo started > {o}; read x < {i}; cat",
            e = effects.display(),
            o = fifo_out.display(),
            i = fifo_in.display()
        ),
    ];
    let mut runner = rt.block_on(async { Runner::open(opts.clone()) }).unwrap();
    rt.block_on(async { runner.start("traj-3", None, "look it up") })
        .unwrap();
    let task = rt.spawn(async move { runner.run().await });
    // Opening the fifo blocks until the tool writes to it: the tool is running now.
    let line = std::fs::read_to_string(&fifo_out).unwrap();
    assert_eq!(line, "started\n");
    task.abort();
    // The crash: every task of the harness gone, the tool's process killed with it.
    rt.shutdown_timeout(Duration::from_secs(10));
    let snapshots = std::fs::read_dir(opts.data.join("journal"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".snap")
        })
        .count();
    assert_eq!(
        snapshots > 0,
        journal.compact_bytes == 1,
        "{snapshots} snapshots"
    );

    let rt = runtime();
    let mut runner = rt.block_on(async { Runner::open(opts) }).unwrap();
    let rec = runner.record("traj-3").unwrap();
    assert_eq!(
        rec.state,
        State::WaitingTool,
        "the journal had the call dispatched"
    );
    let runner = rt.block_on(async move {
        runner.run().await.unwrap();
        runner
    });
    let rec = runner.record("traj-3").unwrap();
    assert_eq!(rec.state, State::Completed);
    assert_eq!(
        std::fs::read_to_string(&effects).unwrap(),
        "started\n",
        "the call ran once"
    );
    let calls = server.calls();
    assert_eq!(calls.len(), 2);
    let obs = calls[1]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["tool_call_id"] == "c1")
        .cloned()
        .unwrap();
    assert!(
        obs["content"].as_str().unwrap().contains("UNKNOWN"),
        "{obs}"
    );
    // The gate was told too: the effect is settled as unknown, not left in flight.
    let (code, out, _) = d.cli(&["report", "traj-3", "--json"]);
    assert_eq!(code, 0);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let item = find_key(&report, "c1").unwrap_or_else(|| panic!("{report:#}"));
    assert_eq!(item["status"], "unknown", "{report:#}");
}

/// The object of a JSON tree whose `key` is `key`.
fn find_key<'a>(v: &'a serde_json::Value, key: &str) -> Option<&'a serde_json::Value> {
    match v {
        serde_json::Value::Object(m) if m.get("key").and_then(|k| k.as_str()) == Some(key) => {
            Some(v)
        }
        serde_json::Value::Object(m) => m.values().find_map(|x| find_key(x, key)),
        serde_json::Value::Array(a) => a.iter().find_map(|x| find_key(x, key)),
        _ => None,
    }
}

/// An agent.toml with the scripted model at `base_url`, a `turns` budget and one read-only
/// command tool, `lookup` (`cat`: it answers its arguments).
fn lookup_config(base_url: &str, turns: u64) -> String {
    format!(
        r#"
[[model]]
name = "scripted"
base_url = "{base_url}"
usd_per_mtok_input = 3.0
usd_per_mtok_output = 15.0

[budget]
turns = {turns}

[[tool]]
name = "lookup"
command = ["cat"]
read_only = true
"#
    )
}

/// `estop agent run` with a config file: a tool call, then the budget's turn ceiling stops the
/// trajectory before a second model call (FAILED, BUDGET_EXCEEDED naming `turns`, exit 3); the
/// same with room for two turns completes with the model's answer (exit 0).
#[test]
fn estop_agent_run_follows_its_config_file() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let rt = runtime();
    let script = Script {
        responses: vec![
            scripted::call("c1", "lookup", "{\"q\": \"x\"}"),
            scripted::call("c2", "lookup", "{\"q\": \"y\"}"),
            scripted::answer("found it"),
        ],
    };
    let server = model_server(&rt, script.responses);
    let config = |turns: u64| {
        format!(
            "[harness]\nsystem = \"Be brief.\"\n{}",
            lookup_config(&server.base_url(), turns)
        )
    };
    let path = d.data().join("agent.toml");
    std::fs::write(&path, config(1)).unwrap();
    let path_s = path.display().to_string();
    let run = |id: &str| {
        d.cli(&[
            "agent", "run", "--config", &path_s, "--model", "scripted", "--tools", "lookup",
            "--id", id, "find x",
        ])
    };
    let (code, out, err) = run("a-1");
    assert_eq!(code, 3, "{out}{err}");
    assert!(out.starts_with("a-1 FAILED turns=1"), "{out}");
    assert!(
        out.contains(r#""exit":"BUDGET_EXCEEDED","dimension":"turns""#),
        "{out}"
    );
    assert_eq!(server.calls().len(), 1, "no call past the ceiling");
    assert_eq!(server.calls()[0]["messages"][0]["content"], "Be brief.");
    std::fs::write(&path, config(2)).unwrap();
    let (code, out, err) = run("a-2");
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("a-2 COMPLETED turns=2"), "{out}");
    assert!(out.trim_end().ends_with("found it"), "{out}");
    // A trajectory id the gate would refuse as a run id is refused before anything starts.
    let (code, _, err) = run("bad\u{202e}id");
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("cannot be a run id"), "{err}");
    assert_eq!(server.calls().len(), 3, "no model call for it");
    // An unknown model is an error that names what the file has.
    let (code, _, err) = d.cli(&["agent", "run", "--config", &path_s, "--model", "gpt", "x"]);
    assert_eq!(code, 1);
    assert!(err.contains("\"scripted\""), "{err}");
}

/// The task contract (`[contract]` in the config, or `--contract FILE`): an answer that misses
/// it (no `total` key) gets a notice turn naming the check, and the second answer, passing,
/// completes — exactly three model calls, the third ending with the notice; the record shows
/// the contract in its identity and the check's result. With a contract whose check fails
/// again, the trajectory ends FAILED naming the check (exit 3), never COMPLETED.
#[test]
fn an_answer_that_misses_its_contract_gets_a_notice_turn_then_completes() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let rt = runtime();
    let server = model_server(
        &rt,
        vec![
            scripted::call("c1", "lookup", "{\"q\": \"x\"}"),
            scripted::answer("{\"sum\": 3}"),
            scripted::answer("{\"total\": 3}"),
            // The second run: `--contract` wants `done` and a call of lookup, twice missed.
            scripted::answer("{\"total\": 3}"),
            scripted::answer("still no"),
        ],
    );
    let path = d.data().join("agent.toml");
    std::fs::write(
        &path,
        format!(
            "{}\n[contract]\nanswer_format = \"json\"\nrequired_keys = [\"total\"]\n\
             must_call = [\"lookup\"]\n",
            lookup_config(&server.base_url(), 10)
        ),
    )
    .unwrap();
    let path_s = path.display().to_string();
    let (code, out, err) = d.cli(&[
        "agent", "run", "--config", &path_s, "--model", "scripted", "--id", "k-1", "--json",
        "count x",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let rec: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(rec["state"], "COMPLETED", "{rec}");
    assert_eq!(
        rec["identity"]["contract"],
        json!({"answer_format": "json", "required_keys": ["total"], "must_call": ["lookup"],
               "attempts": 1})
    );
    assert_eq!(rec["called_ok"], json!(["lookup"]));
    assert_eq!(rec["check"]["passed"], true);
    assert_eq!(rec["check"]["notices"], 1);
    let calls = server.calls();
    assert_eq!(
        calls.len(),
        3,
        "the call, the missed answer, the notice turn"
    );
    let last = calls[2]["messages"].as_array().unwrap();
    assert_eq!(last[last.len() - 2]["content"], "{\"sum\": 3}");
    let notice = last[last.len() - 1].clone();
    assert_eq!(notice["role"], "user");
    let text = notice["content"].as_str().unwrap();
    assert!(
        text.starts_with("[completion check failed: required_keys:") && text.contains("total"),
        "{text}"
    );
    // The same from --contract: must_call unmet and no `done`, twice: FAILED, naming both.
    let contract = d.data().join("contract.toml");
    std::fs::write(
        &contract,
        "answer_matches = \"done\"\nmust_call = [\"lookup\"]\nattempts = 1\n",
    )
    .unwrap();
    let (code, out, err) = d.cli(&[
        "agent",
        "run",
        "--config",
        &path_s,
        "--model",
        "scripted",
        "--id",
        "k-2",
        "--contract",
        &contract.display().to_string(),
        "count y",
    ]);
    assert_eq!(code, 3, "{out}{err}");
    assert!(out.starts_with("k-2 FAILED turns=2"), "{out}");
    assert!(
        out.contains(r#""exit":"COMPLETION_CHECK_FAILED","failed":["answer_matches","must_call"]"#),
        "{out}"
    );
    assert_eq!(server.calls().len(), 5);
    // A contract that would let a path leave the workspace is refused before anything starts.
    std::fs::write(&contract, "workspace_files = [\"../x\"]\n").unwrap();
    let (code, _, err) = d.cli(&[
        "agent",
        "run",
        "--config",
        &path_s,
        "--model",
        "scripted",
        "--contract",
        &contract.display().to_string(),
        "z",
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("workspace_files"), "{err}");
    assert_eq!(server.calls().len(), 5);
}

/// `estop agent run --retry-of ID`: a retry is a new trajectory linked to the one it retries,
/// with its task and parent, whose budget carries over (seed 004): a trajectory that ran out of
/// turns is retried into the same ceiling and stops at once with no model call; one that failed
/// on the provider's 400 is retried with room left and completes, its spend counting on from
/// the first's. A completed trajectory, one not in the journal, one retried already and a new
/// parent are refused.
#[test]
fn a_retry_is_a_new_trajectory_whose_budget_carries_over() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let rt = runtime();
    let script = Script {
        responses: vec![
            scripted::call("c1", "lookup", "{\"q\": \"x\"}"),
            vec![Step::Status {
                status: 400,
                body: "{\"error\": \"bad request\"}".into(),
            }],
            scripted::answer("found it"),
        ],
    };
    let server = model_server(&rt, script.responses);
    let config = |turns: u64| lookup_config(&server.base_url(), turns);
    let path = d.data().join("agent.toml");
    let path_s = path.display().to_string();
    let agent = |args: &[&str]| {
        let mut all = vec![
            "agent", "run", "--config", &path_s, "--model", "scripted", "--json",
        ];
        all.extend_from_slice(args);
        let (code, out, err) = d.cli(&all);
        let record = serde_json::from_str::<serde_json::Value>(&out).ok();
        (code, record, format!("{out}{err}"))
    };
    std::fs::write(&path, config(1)).unwrap();
    let (code, first, out) = agent(&["--id", "r-1", "find x"]);
    assert_eq!(code, 3, "{out}");
    let first = first.unwrap();
    assert_eq!(first["exit"]["dimension"], "turns", "{first:#}");
    assert_eq!(server.calls().len(), 1);
    // Retried into the same ceiling: the turn it spent counts, so it stops before any call.
    let (code, retry, out) = agent(&["--retry-of", "r-1", "--id", "r-1b"]);
    assert_eq!(code, 3, "{out}");
    let retry = retry.unwrap();
    assert_eq!(retry["identity"]["retry_of"], "r-1", "{retry:#}");
    assert_eq!(retry["identity"]["task"], "find x");
    assert_eq!(retry["exit"]["dimension"], "turns", "{retry:#}");
    assert_eq!(
        retry["budget"]["spend"]["turns"],
        first["budget"]["spend"]["turns"]
    );
    assert_eq!(server.calls().len(), 1, "a retry buys no fresh budget");

    // A failure with room left: the retry runs the same task and its spend counts on.
    std::fs::write(&path, config(5)).unwrap();
    let (code, failed, out) = agent(&["--id", "r-2", "find y"]);
    assert_eq!(code, 3, "{out}");
    let failed = failed.unwrap();
    assert_eq!(failed["state"], "FAILED", "{failed:#}");
    let (code, retry, out) = agent(&["--retry-of", "r-2", "--id", "r-2b"]);
    assert_eq!(code, 0, "{out}");
    let retry = retry.unwrap();
    assert_eq!(retry["state"], "COMPLETED", "{retry:#}");
    assert_eq!(retry["identity"]["retry_of"], "r-2");
    let turns = |r: &serde_json::Value| r["budget"]["spend"]["turns"].as_u64().unwrap();
    assert_eq!(turns(&retry), turns(&failed) + 1, "{retry:#}");
    assert_eq!(retry["budget"]["limits"]["turns_max"], 5);
    // Its wall clock counts on from the first's too (measured to the first's end).
    let at = |r: &serde_json::Value, f: &str| r[f].as_u64().unwrap_or_else(|| panic!("{f}: {r:#}"));
    let spent = at(&failed, "ended_at_ms") - failed["budget"]["started_at_ms"].as_u64().unwrap();
    let began = retry["budget"]["started_at_ms"].as_u64().unwrap();
    assert!(began + spent >= at(&failed, "ended_at_ms"), "{retry:#}");
    assert!(at(&retry, "ended_at_ms") - began >= spent, "{retry:#}");
    let last = &server.calls()[2]["messages"];
    assert_eq!(last[1]["content"], "find y", "the retry's task: {last}");

    // Refused, with the reason: nothing to retry, no such trajectory, a parent of its own.
    let (code, _, out) = agent(&["--retry-of", "r-2b"]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("completed: there is nothing to retry"),
        "{out}"
    );
    let (code, _, out) = agent(&["--retry-of", "nope"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("no trajectory \"nope\""), "{out}");
    let (code, _, out) = agent(&["--retry-of", "r-1"]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("retried already as \"r-1b\": retry that one"),
        "a second retry would buy back the first retry's spend: {out}"
    );
    let (code, _, out) = agent(&["--retry-of", "r-2", "--parent", "elsewhere"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("leave out --parent"), "{out}");
    assert_eq!(server.calls().len(), 3, "no model call for a refused retry");
}

/// A trajectory's class is the scheduler's: with one worker, an interactive trajectory
/// started after a batch one has its turn first (weights 4 and 1; FIFO if both were
/// standard). The class is in the record, so a reopened runner keeps it, and a retry inherits
/// it unless it names another.
#[test]
fn a_trajectorys_class_orders_the_turns_and_is_kept_in_its_record() {
    use estop_harness::scheduler::Class;
    let d = Daemon::start_with_policy(POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::answer("first"),
            scripted::answer("second"),
            vec![Step::Status {
                status: 400,
                body: "{\"error\": \"bad request\"}".into(),
            }],
            scripted::answer("retried"),
        ],
    );
    let mut opts = options(&d, &model.base_url(), &d.data().join("effects"));
    opts.workers = 1;
    let mut runner = rt.block_on(async { Runner::open(opts.clone()) }).unwrap();
    rt.block_on(async {
        runner.start_in("cl-b", None, "the batch task", Class::Batch)?;
        runner.start_in("cl-i", None, "the interactive task", Class::Interactive)?;
        runner.run().await
    })
    .unwrap();
    let task = |n: usize| messages(&model, n)[1]["content"].clone();
    assert_eq!(task(0), "the interactive task", "interactive goes first");
    assert_eq!(task(1), "the batch task");
    drop(runner);
    let mut runner = rt.block_on(async { Runner::open(opts) }).unwrap();
    assert_eq!(runner.record("cl-b").unwrap().class, Class::Batch);
    assert_eq!(runner.record("cl-i").unwrap().class, Class::Interactive);
    rt.block_on(async {
        runner.start_in("cl-f", None, "fails", Class::Batch)?;
        runner.run().await?;
        runner.start_retry("cl-f2", "cl-f", None, None)?;
        runner.run().await
    })
    .unwrap();
    assert_eq!(runner.record("cl-f").unwrap().state, State::Failed);
    assert_eq!(
        runner.record("cl-f2").unwrap().class,
        Class::Batch,
        "inherited"
    );
    assert_eq!(runner.record("cl-f2").unwrap().state, State::Completed);
}

/// A resume keeps the class recorded: `estop agent run --id` of a live batch trajectory naming
/// another class is refused before anything runs; without `--class` (or with its own) it resumes
/// in its class and completes.
#[test]
fn a_resume_keeps_the_recorded_class_and_refuses_another() {
    use estop_harness::scheduler::Class;
    let d = Daemon::start_with_policy(POLICY, &[]);
    let server_rt = runtime();
    let model = model_server(
        &server_rt,
        vec![vec![Step::Gate, Step::Done], scripted::answer("resumed")],
    );
    let opts = options(&d, &model.base_url(), &d.data().join("effects"));
    let rt = runtime();
    let mut runner = rt.block_on(async { Runner::open(opts) }).unwrap();
    rt.block_on(async { runner.start_in("rk-1", None, "keep it", Class::Batch) })
        .unwrap();
    let task = rt.spawn(async move { runner.run().await });
    server_rt.block_on(model.wait_for(&Seen::Call { n: 0 }));
    task.abort();
    rt.shutdown_timeout(Duration::from_secs(10));

    let path = d.data().join("agent.toml");
    std::fs::write(&path, lookup_config(&model.base_url(), 5)).unwrap();
    let path = path.display().to_string();
    let resume = |class: &[&str]| {
        let mut all = vec![
            "agent", "run", "--config", &path, "--model", "scripted", "--json", "--id", "rk-1",
        ];
        all.extend_from_slice(class);
        all.push("keep it");
        d.cli(&all)
    };
    let (code, out, err) = resume(&["--class", "interactive"]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("live in class batch: a resume keeps it"),
        "{err}"
    );
    assert_eq!(model.calls().len(), 1, "nothing ran for the refused resume");
    let (code, out, err) = resume(&["--class", "batch"]);
    assert_eq!(code, 0, "{out}{err}");
    let record: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (record["state"].as_str(), record["class"].as_str()),
        (Some("COMPLETED"), Some("batch"))
    );
}

/// `estop agent run --class`: recorded (the `--json` record, `estop agent list`), inherited
/// by a retry unless given there too; a class that is none of the three is refused before
/// anything starts.
#[test]
fn estop_agent_run_class_is_recorded_listed_and_inherited_by_a_retry() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let rt = runtime();
    let server = model_server(&rt, vec![scripted::call("c1", "lookup", "{\"q\": \"x\"}")]);
    let path = d.data().join("agent.toml");
    std::fs::write(&path, lookup_config(&server.base_url(), 1)).unwrap();
    let path_s = path.display().to_string();
    let agent = |args: &[&str]| {
        let mut all = vec![
            "agent", "run", "--config", &path_s, "--model", "scripted", "--json",
        ];
        all.extend_from_slice(args);
        let (code, out, err) = d.cli(&all);
        let record = serde_json::from_str::<serde_json::Value>(&out).ok();
        (code, record, format!("{out}{err}"))
    };
    let (code, _, out) = agent(&["--class", "urgent", "--id", "k-0", "x"]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("use interactive, standard or batch"), "{out}");
    assert!(server.calls().is_empty());
    let (code, first, out) = agent(&["--class", "batch", "--id", "k-1", "find x"]);
    assert_eq!(code, 3, "out of turns: {out}");
    assert_eq!(first.unwrap()["class"], "batch", "{out}");
    let (_, list, _) = d.cli(&["agent", "list"]);
    assert!(
        list.starts_with("k-1 FAILED ") && list.contains(" class=batch task="),
        "{list}"
    );
    // A retry (under the same spent ceiling: it stops at once) has the class it retries,
    // unless it names one.
    let (code, retry, out) = agent(&["--retry-of", "k-1", "--id", "k-1b"]);
    assert_eq!(code, 3, "{out}");
    assert_eq!(retry.unwrap()["class"], "batch", "{out}");
    let (code, retry, out) = agent(&[
        "--retry-of",
        "k-1b",
        "--id",
        "k-1c",
        "--class",
        "interactive",
    ]);
    assert_eq!(code, 3, "{out}");
    assert_eq!(retry.unwrap()["class"], "interactive", "{out}");
    let (_, list, _) = d.cli(&["agent", "list", "--json"]);
    let list: serde_json::Value = serde_json::from_str(&list).unwrap();
    let classes: Vec<(&str, &str)> = list["trajectories"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["id"].as_str().unwrap(), t["class"].as_str().unwrap()))
        .collect();
    assert_eq!(
        classes,
        [("k-1", "batch"), ("k-1b", "batch"), ("k-1c", "interactive")]
    );
}

/// `estop kill` of the run while a tool call runs: the kill reaches the loop at once (not at a
/// boundary: the tool would never return), the call is cancelled and settled `unknown` at the
/// gate, and the trajectory ends FAILED with the kill as its exit; no model call follows.
#[test]
fn a_kill_at_the_gate_acts_at_once_mid_tool() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let effects = d.data().join("effects");
    let fifo_out = d.data().join("out");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo_out)
            .status()
            .unwrap()
            .success()
    );
    let rt = runtime();
    let script = Script {
        responses: vec![
            scripted::call("c1", "lookup", "{}"),
            scripted::answer("never asked"),
        ],
    };
    let server = model_server(&rt, script.responses);
    let mut opts = options(&d, &server.base_url(), &effects);
    // Announces itself, then never returns on its own.
    opts.tools[0].command = vec![
        "sh".into(),
        "-c".into(),
        format!("echo started > {}; exec sleep 1000", fifo_out.display()),
    ];
    let mut runner = rt.block_on(async { Runner::open(opts) }).unwrap();
    rt.block_on(async { runner.start("traj-4", None, "look") })
        .unwrap();
    let run = rt.spawn(async move {
        runner.run().await.unwrap();
        runner
    });
    assert_eq!(std::fs::read_to_string(&fifo_out).unwrap(), "started\n");
    let (code, _, err) = d.cli(&["kill", "traj-4", "--reason", "runaway"]);
    assert_eq!(code, 0, "{err}");
    let runner = rt.block_on(run).unwrap();
    let rec = runner.record("traj-4").unwrap();
    assert_eq!(rec.state, State::Failed);
    assert!(
        matches!(&rec.exit, Some(Exit::Killed { .. })),
        "{:?}",
        rec.exit
    );
    assert_eq!(server.calls().len(), 1, "no model call after the kill");
    let obs = runner
        .context("traj-4")
        .iter()
        .find(|m| m.tool_call_id.as_deref() == Some("c1"))
        .cloned()
        .unwrap();
    assert!(obs.content.unwrap().contains("INTERRUPTED"));
    // Killed mid-call: its outcome is unknown, and the gate's report says so.
    let (code, out, _) = d.cli(&["report", "traj-4", "--json"]);
    assert_eq!(code, 0);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let item = find_key(&report, "c1").unwrap_or_else(|| panic!("{report:#}"));
    assert_eq!(item["status"], "unknown", "{report:#}");
}

/// An HTTP tool: the arguments are POSTed as JSON to its URL (after the gate admitted the
/// call), and the answer's body is the model's observation; a 5xx answer is an error
/// observation the gate records as the effect's error.
const HTTP_POLICY: &str = r#"
[defaults]
unknown_tool = "approve"
approval_expiry = "10m"

[[rules]]
tool = "fetch"
action = "allow"

[[rules]]
tool = "local"
action = "allow"

[[rules]]
tool = "delegate"
action = "allow"

[[rules]]
tool = "http.POST"
when = 'args.path == "/orders"'
action = "allow"

[[rules]]
tool = "http.POST"
when = 'args.path == "/held"'
action = "approve"

[[rules]]
tool = "http.*"
action = "deny"
"#;

/// The credential the HTTP tool tests' store injects for 127.0.0.2.
const SECRET: &str = "sekrit-4711-never-seen";

/// An HTTP tool `fetch` POSTing to `url`, under `[egress]` settings that let it reach 127.0.0.2
/// (a loopback address the proxy refuses by default) with the credential store holding
/// [`SECRET`] for that host, both written in `dir` (the store 0600).
fn http_tool(dir: &std::path::Path, url: &str) -> Tool {
    use std::os::unix::fs::PermissionsExt;
    let store = dir.join("credentials.toml");
    std::fs::write(
        &store,
        format!(
            "[[credential]]\nhost = \"127.0.0.2\"\nplain_http = true\nheader = \"X-Api-Key\"\nvalue = \"{SECRET}\"\n"
        ),
    )
    .unwrap();
    std::fs::set_permissions(&store, std::fs::Permissions::from_mode(0o600)).unwrap();
    let settings = dir.join("egress.toml");
    std::fs::write(
        &settings,
        format!(
            "[egress]\nallow_destinations = [\"127.0.0.2/32\"]\ncredentials = {:?}\n",
            store.display().to_string()
        ),
    )
    .unwrap();
    Tool {
        name: "fetch".into(),
        description: "fetch an order".into(),
        parameters: json!({"type": "object"}),
        url: Some(url.to_string()),
        read_only: true,
        egress: Some(estop_harness::http::Egress::load(&settings).unwrap()),
        ..Tool::default()
    }
}

/// Every file's bytes under `dir`, concatenated.
fn all_bytes(dir: &std::path::Path) -> Vec<u8> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(all_bytes(&p));
        } else if let Ok(b) = std::fs::read(&p) {
            out.extend(b);
        }
    }
    out
}

/// An HTTP tool's request goes out through the egress proxy as the call's own run
/// `TRAJECTORY/CALL`, a child of the trajectory's: the gate admits the tool call under the
/// trajectory and the `http.POST` under the child (its policy by path), the credential is
/// injected for its host and appears nowhere else — not in the model's view, the journal or
/// the ledger — and each child run is closed with the call's outcome.
#[test]
fn an_http_tool_goes_through_the_proxy_as_a_child_run_with_its_credential() {
    let d = Daemon::start_with_policy(HTTP_POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "fetch", "{\"id\": 7}"),
            scripted::call("c2", "fetch", "{\"id\": 8}"),
            scripted::answer("order 7 has 3 rows"),
        ],
    );
    let upstream = rt
        .block_on(Scripted::start(
            "127.0.0.2:0",
            Script {
                responses: vec![
                    vec![Step::Status {
                        status: 200,
                        body: "{\"rows\": 3}".into(),
                    }],
                    vec![Step::Status {
                        status: 503,
                        body: "down".into(),
                    }],
                ],
            },
        ))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(&d, &model.base_url(), &d.data().join("effects"));
    let url = format!("http://{}/orders", upstream.addr);
    opts.tools = vec![http_tool(dir.path(), &url)];
    let mut runner = rt.block_on(async { Runner::open(opts) }).unwrap();
    rt.block_on(async { runner.start("traj-5", None, "count order 7") })
        .unwrap();
    let runner = rt.block_on(async move {
        runner.run().await.unwrap();
        runner
    });
    assert_eq!(runner.record("traj-5").unwrap().state, State::Completed);
    assert_eq!(upstream.calls(), [json!({"id": 7}), json!({"id": 8})]);
    for h in upstream.headers() {
        assert!(
            h.contains(&("x-api-key".to_string(), SECRET.to_string())),
            "the credential was injected: {h:?}"
        );
    }
    let last = model.calls()[2]["messages"].as_array().unwrap().clone();
    let obs = |id: &str| last.iter().find(|m| m["tool_call_id"] == id).unwrap()["content"].clone();
    assert_eq!(obs("c1"), "{\"rows\": 3}");
    assert!(
        obs("c2").as_str().unwrap().contains("HTTP 503"),
        "{}",
        obs("c2")
    );
    assert_eq!(effect_status(&d, "traj-5", "c1"), "completed");
    assert_eq!(effect_status(&d, "traj-5", "c2"), "failed");
    // The request itself: an effect of the call's own run, beneath the tool call.
    assert_eq!(effect_status(&d, "traj-5/c1", "idem:c1"), "completed");
    assert_eq!(effect_status(&d, "traj-5/c2", "idem:c2"), "completed");
    for (child, state) in [("traj-5/c1", "completed"), ("traj-5/c2", "failed")] {
        let (code, out, err) = d.cli(&["status", child, "--json"]);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            (v["state"].as_str(), v["parent"].as_str()),
            (Some(state), Some("traj-5")),
            "{v}"
        );
    }
    let (_, report, _) = d.cli(&["report", "traj-5/c1", "--json"]);
    assert!(report.contains("\"tool\":\"http.POST\""), "{report}");
    let secret = SECRET.as_bytes();
    let holds = |b: &[u8]| b.windows(secret.len()).any(|w| w == secret);
    assert!(
        !holds(serde_json::to_string(&model.calls()).unwrap().as_bytes()),
        "the model saw it"
    );
    assert!(
        !holds(&all_bytes(&d.data().join("harness"))),
        "the journal holds it"
    );
    assert!(
        !holds(&all_bytes(&d.data().join("ledger"))),
        "the ledger holds it"
    );
    assert!(!holds(report.as_bytes()));
}

/// A trajectory is leased a handle to its HTTP tool's credential (the tool and host, never the
/// secret): `estop agent status --json` shows it while the trajectory runs, the call's request
/// carries the credential, FINALIZING releases the handle, and the secret is nowhere in the
/// journal or the status.
#[test]
fn a_credential_handle_is_leased_per_trajectory_and_released_at_finalizing() {
    let d = Daemon::start_with_policy(HTTP_POLICY, &[]);
    let rt = runtime();
    let mut first = vec![Step::Gate];
    first.extend(scripted::call("c1", "fetch", "{\"id\": 7}"));
    let model = model_server(&rt, vec![first, scripted::answer("7 has 3 rows")]);
    let upstream = rt
        .block_on(Scripted::start(
            "127.0.0.2:0",
            Script {
                responses: vec![vec![Step::Status {
                    status: 200,
                    body: "{\"rows\": 3}".into(),
                }]],
            },
        ))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(&d, &model.base_url(), &d.data().join("effects"));
    opts.tools = vec![http_tool(
        dir.path(),
        &format!("http://{}/orders", upstream.addr),
    )];
    let run = spawn_runner(&rt, opts, "cred-1");
    rt.block_on(model.wait_for(&Seen::Call { n: 0 }));
    let (code, out, err) = d.cli(&["agent", "status", "cred-1", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v["record"]["leases"],
        json!([{"id": "fetch@127.0.0.2", "kind": "credential", "tool": "fetch"}]),
        "{v}"
    );
    assert!(!out.contains(SECRET));
    model.release(1);
    let runner = rt.block_on(run).unwrap();
    let rec = runner.record("cred-1").unwrap();
    assert_eq!(rec.state, State::Completed);
    assert!(rec.leases.is_empty(), "released at FINALIZING");
    assert!(
        upstream.headers()[0].contains(&("x-api-key".to_string(), SECRET.to_string())),
        "leased: injected"
    );
    let journal = all_bytes(&d.data().join("harness"));
    let holds = |b: &[u8], s: &[u8]| b.windows(s.len()).any(|w| w == s);
    assert!(
        holds(&journal, b"fetch@127.0.0.2"),
        "the lease is journalled"
    );
    assert!(
        !holds(&journal, SECRET.as_bytes()),
        "the journal holds the secret"
    );
}

/// A credential of the tool's store that the tool is not leased (its `credentials` names
/// another host) is not injected: the request goes without it.
#[test]
fn a_credential_not_leased_to_the_trajectory_is_not_injected() {
    let d = Daemon::start_with_policy(HTTP_POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "fetch", "{\"id\": 7}"),
            scripted::answer("done"),
        ],
    );
    let upstream = rt
        .block_on(Scripted::start(
            "127.0.0.2:0",
            Script {
                responses: vec![vec![Step::Status {
                    status: 200,
                    body: "{}".into(),
                }]],
            },
        ))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(&d, &model.base_url(), &d.data().join("effects"));
    let mut tool = http_tool(dir.path(), &format!("http://{}/orders", upstream.addr));
    tool.credentials = Some(vec!["orders.example".into()]);
    opts.tools = vec![tool];
    let run = spawn_runner(&rt, opts, "cred-2");
    let runner = rt.block_on(run).unwrap();
    let rec = runner.record("cred-2").unwrap();
    assert_eq!(rec.state, State::Completed);
    let headers = upstream.headers();
    assert_eq!(headers.len(), 1, "the request went");
    assert!(
        !headers[0].iter().any(|(k, _)| k == "x-api-key"),
        "not leased: not injected: {:?}",
        headers[0]
    );
}

/// `estop agent run` with an HTTP tool and a sub-agent tool from its config file: the tool's
/// `egress_policy` (and its credential store) loaded at start, the request sent through the
/// proxy with the credential, a sub-agent making it, and the secret in none of the command's
/// output (`--json`, the whole record).
#[test]
fn estop_agent_run_takes_http_tools_and_sub_agents_from_its_config() {
    let d = Daemon::start_with_policy(HTTP_POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "delegate", "{\"task\": \"fetch order 7\"}"),
            scripted::call("c1", "fetch", "{\"id\": 7}"),
            scripted::answer("3 rows"),
            scripted::answer("order 7 has 3 rows"),
        ],
    );
    let upstream = rt
        .block_on(Scripted::start(
            "127.0.0.2:0",
            Script {
                responses: vec![vec![Step::Status {
                    status: 200,
                    body: "{\"rows\": 3}".into(),
                }]],
            },
        ))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    http_tool(dir.path(), "http://unused/");
    let config = dir.path().join("agent.toml");
    let text = format!(
        "[[model]]\nname = \"scripted\"\nbase_url = \"{}\"\nusd_per_mtok_input = 3.0\n\
         usd_per_mtok_output = 15.0\n\n[subagents]\n\n[[tool]]\nname = \"fetch\"\n\
         url = \"http://{}/orders\"\nread_only = true\negress_policy = {:?}\n",
        model.base_url(),
        upstream.addr,
        dir.path().join("egress.toml").display().to_string()
    );
    std::fs::write(&config, text).unwrap();
    let (code, out, err) = d.cli(&[
        "agent",
        "run",
        "--config",
        config.to_str().unwrap(),
        "--model",
        "scripted",
        "--id",
        "cfg-1",
        "--json",
        "count order 7",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let rec: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(rec["state"], "COMPLETED", "{rec}");
    assert_eq!(
        rec["budget"]["spend"]["turns"], 4,
        "its 2 turns and its sub-agent's 2"
    );
    assert_eq!(upstream.calls(), [json!({"id": 7})]);
    assert!(
        upstream.headers()[0].contains(&("x-api-key".to_string(), SECRET.to_string())),
        "{:?}",
        upstream.headers()
    );
    assert!(!out.contains(SECRET) && !err.contains(SECRET));
    assert_eq!(effect_status(&d, "cfg-1/c1/c1", "idem:c1"), "completed");
    let (_, status, _) = d.cli(&["status", "cfg-1/c1/c1", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(v["parent"], "cfg-1/c1", "{v}");
}

/// Requests the gate does not admit reach nothing, and the model reads seed 004's structured
/// refusal: a path the policy denies, and a loopback destination the tool's settings do not
/// allow (refused by the proxy before anything is resolved or dialled).
#[test]
fn an_http_tool_refused_by_policy_or_destination_dials_nothing() {
    let d = Daemon::start_with_policy(HTTP_POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "fetch", "{\"id\": 7}"),
            scripted::call("c2", "local", "{\"id\": 8}"),
            scripted::answer("could not"),
        ],
    );
    let upstream = rt
        .block_on(Scripted::start(
            "127.0.0.2:0",
            Script {
                responses: Vec::new(),
            },
        ))
        .unwrap();
    let local = model_server(&rt, Vec::new());
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(&d, &model.base_url(), &d.data().join("effects"));
    let denied = http_tool(dir.path(), &format!("http://{}/admin", upstream.addr));
    let mut loopback = http_tool(dir.path(), &format!("http://{}/orders", local.addr));
    loopback.name = "local".into();
    opts.tools = vec![denied, loopback];
    let mut runner = rt.block_on(async { Runner::open(opts) }).unwrap();
    rt.block_on(async { runner.start("traj-6", None, "try") })
        .unwrap();
    let runner = rt.block_on(async move {
        runner.run().await.unwrap();
        runner
    });
    assert_eq!(runner.record("traj-6").unwrap().state, State::Completed);
    assert!(
        upstream.calls().is_empty() && local.calls().is_empty(),
        "nothing was dialled"
    );
    let last = model.calls()[2]["messages"].as_array().unwrap().clone();
    let obs = |id: &str| -> serde_json::Value {
        let m = last.iter().find(|m| m["tool_call_id"] == id).unwrap();
        serde_json::from_str(m["content"].as_str().unwrap()).unwrap()
    };
    assert_eq!(
        (obs("c1")["status"].as_str(), obs("c1")["reason"].as_str()),
        (Some("REFUSED"), Some("DENIED")),
        "{}",
        obs("c1")
    );
    assert_eq!(obs("c1")["call"], "fetch({\"id\": 7})");
    assert_eq!(obs("c2")["reason"], "DESTINATION", "{}", obs("c2"));
    assert_eq!(effect_status(&d, "traj-6", "c1"), "failed");
    assert_eq!(effect_status(&d, "traj-6/c1", "idem:c1"), "refused");
}

/// Polls `estop agent status ID` until its first line starts with `ID STATE` (10 s at most);
/// returns the whole output.
fn status_becomes(d: &Daemon, id: &str, state: &str) -> String {
    status_until(d, id, |out| out.starts_with(&format!("{id} {state} ")))
}

/// Polls `estop agent status ID` until `done` holds of its output (10 s at most); returns
/// the last output.
fn status_until(d: &Daemon, id: &str, done: impl Fn(&str) -> bool) -> String {
    common::poll(Duration::from_secs(10), Duration::from_millis(50), || {
        let (_, out, _) = d.cli(&["agent", "status", id]);
        (done(&out), out)
    })
}

/// A request the policy holds is found before the call is dispatched (the harness admits it
/// two-phase with the call): the trajectory is AWAITING_APPROVAL, not WAITING_TOOL, and
/// `estop agent status` names the held request; approved, it is sent exactly once (with its
/// credential) and its answer is the observation; the proxy started the effect the harness
/// admitted, no second one.
#[test]
fn an_http_tool_request_held_for_approval_awaits_approval_and_goes_once_approved() {
    let d = Daemon::start_with_policy(HTTP_POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "fetch", "{\"id\": 9}"),
            scripted::answer("done"),
        ],
    );
    let upstream = rt
        .block_on(Scripted::start(
            "127.0.0.2:0",
            Script {
                responses: vec![vec![Step::Status {
                    status: 200,
                    body: "approved and sent".into(),
                }]],
            },
        ))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(&d, &model.base_url(), &d.data().join("effects"));
    opts.tools = vec![http_tool(
        dir.path(),
        &format!("http://{}/held", upstream.addr),
    )];
    let run = spawn_runner(&rt, opts, "traj-7");
    let out = status_becomes(&d, "traj-7", "AWAITING_APPROVAL");
    assert!(out.starts_with("traj-7 AWAITING_APPROVAL "), "{out}");
    assert!(
        out.contains(&format!(
            "held c1 request traj-7/c1 idem:c1 http.POST http://{}/held",
            upstream.addr
        )),
        "{out}"
    );
    assert!(upstream.calls().is_empty(), "nothing sent while held");
    assert_eq!(effect_status(&d, "traj-7/c1", "idem:c1"), "held");
    // The journal's view (the console's, `estop agent list --json`) names it too.
    let (code, out, err) = d.cli(&["agent", "list", "--json"]);
    assert_eq!(code, 0, "{err}");
    let page: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        page["trajectories"][0]["held"][0]["request"],
        json!({"run": "traj-7/c1", "key": "idem:c1", "tool": "http.POST",
            "url": format!("http://{}/held", upstream.addr)}),
        "{page}"
    );
    let (code, _, err) = d.cli(&["approve", "traj-7/c1", "idem:c1"]);
    assert_eq!(code, 0, "{err}");
    let runner = rt.block_on(run).unwrap();
    assert_eq!(runner.record("traj-7").unwrap().state, State::Completed);
    assert_eq!(upstream.calls(), [json!({"id": 9})], "sent exactly once");
    assert!(upstream.headers()[0].contains(&("x-api-key".to_string(), SECRET.to_string())));
    let last = model.calls()[1]["messages"].as_array().unwrap().clone();
    let obs = last.iter().find(|m| m["tool_call_id"] == "c1").unwrap();
    assert_eq!(obs["content"], "approved and sent");
    assert_eq!(effect_status(&d, "traj-7/c1", "idem:c1"), "completed");
    assert_eq!(effect_status(&d, "traj-7", "c1"), "completed");
    assert_one_request_effect(&d, "traj-7/c1");
}

/// Polls `estop agent status ID` until it holds `text` (10 s at most); returns the output.
fn status_shows(d: &Daemon, id: &str, text: &str) -> String {
    status_until(d, id, |out| out.contains(text))
}

/// A call whose tool the policy holds and whose request it holds too: two approvals, both
/// in AWAITING_APPROVAL — the tool's, then (its request admitted once the tool is approved,
/// before anything is dispatched) the request's; nothing is sent in between, and the request
/// goes once, after the second.
#[test]
fn a_held_tool_whose_request_is_held_too_awaits_both_approvals() {
    let d = Daemon::start_with_policy(HTTP_POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "guarded", "{\"id\": 9}"),
            scripted::answer("done"),
        ],
    );
    let upstream = rt
        .block_on(Scripted::start(
            "127.0.0.2:0",
            Script {
                responses: vec![vec![Step::Status {
                    status: 200,
                    body: "sent".into(),
                }]],
            },
        ))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(&d, &model.base_url(), &d.data().join("effects"));
    // No rule names it: the policy's `unknown_tool = "approve"` holds the call itself.
    let mut tool = http_tool(dir.path(), &format!("http://{}/held", upstream.addr));
    tool.name = "guarded".into();
    opts.tools = vec![tool];
    let run = spawn_runner(&rt, opts, "traj-h");
    let out = status_shows(&d, "traj-h", "held c1 call guarded");
    assert!(out.starts_with("traj-h AWAITING_APPROVAL "), "{out}");
    let (code, _, err) = d.cli(&["approve", "traj-h", "c1"]);
    assert_eq!(code, 0, "{err}");
    let out = status_shows(&d, "traj-h", "held c1 request traj-h/c1 idem:c1 http.POST");
    assert!(out.starts_with("traj-h AWAITING_APPROVAL "), "{out}");
    assert!(out.contains("held c1 request"), "{out}");
    assert!(
        upstream.calls().is_empty(),
        "nothing sent between the approvals"
    );
    let (code, _, err) = d.cli(&["approve", "traj-h/c1", "idem:c1"]);
    assert_eq!(code, 0, "{err}");
    let runner = rt.block_on(run).unwrap();
    assert_eq!(runner.record("traj-h").unwrap().state, State::Completed);
    assert_eq!(upstream.calls(), [json!({"id": 9})], "sent exactly once");
    assert_eq!(effect_status(&d, "traj-h", "c1"), "completed");
    assert_one_request_effect(&d, "traj-h/c1");
}

/// Each held request's run is subscribed to for its decision and unsubscribed once decided:
/// under a daemon that lets a principal hold 2 subscriptions (the trajectory's and one
/// request's), three held requests in a row are each approved and sent once.
#[test]
fn held_requests_one_after_another_do_not_pile_up_subscriptions() {
    let d = Daemon::start_with_policy(HTTP_POLICY, &["--subscriptions-per-principal-max", "2"]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "fetch", "{\"id\": 1}"),
            scripted::call("c2", "fetch", "{\"id\": 2}"),
            scripted::call("c3", "fetch", "{\"id\": 3}"),
            scripted::answer("done"),
        ],
    );
    let ok = || {
        vec![Step::Status {
            status: 200,
            body: "sent".into(),
        }]
    };
    let upstream = rt
        .block_on(Scripted::start(
            "127.0.0.2:0",
            Script {
                responses: vec![ok(), ok(), ok()],
            },
        ))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(&d, &model.base_url(), &d.data().join("effects"));
    opts.tools = vec![http_tool(
        dir.path(),
        &format!("http://{}/held", upstream.addr),
    )];
    let run = spawn_runner(&rt, opts, "traj-s");
    for c in ["c1", "c2", "c3"] {
        let out = status_shows(&d, "traj-s", &format!("held {c} request traj-s/{c}"));
        assert!(out.contains(&format!("held {c} request")), "{out}");
        let (code, _, err) = d.cli(&["approve", &format!("traj-s/{c}"), &format!("idem:{c}")]);
        assert_eq!(code, 0, "{err}");
    }
    let runner = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(30), run).await })
        .expect("every approval was heard")
        .unwrap();
    assert_eq!(runner.record("traj-s").unwrap().state, State::Completed);
    assert_eq!(
        upstream.calls(),
        [json!({"id": 1}), json!({"id": 2}), json!({"id": 3})]
    );
}

/// A held request whose run cannot be subscribed to (the principal's one subscription is the
/// trajectory's) would never hear its decision: silence is no — the model reads
/// `APPROVAL_CANCELED`, nothing is dialled, the trajectory goes on and completes.
#[test]
fn a_held_request_whose_decision_cannot_be_followed_is_canceled() {
    let d = Daemon::start_with_policy(HTTP_POLICY, &["--subscriptions-per-principal-max", "1"]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "fetch", "{\"id\": 1}"),
            scripted::answer("could not"),
        ],
    );
    let upstream = rt
        .block_on(Scripted::start(
            "127.0.0.2:0",
            Script {
                responses: Vec::new(),
            },
        ))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(&d, &model.base_url(), &d.data().join("effects"));
    opts.tools = vec![http_tool(
        dir.path(),
        &format!("http://{}/held", upstream.addr),
    )];
    let runner = rt
        .block_on(async {
            tokio::time::timeout(Duration::from_secs(30), run_to_end(opts, "traj-u")).await
        })
        .expect("the wait ended");
    assert_eq!(runner.record("traj-u").unwrap().state, State::Completed);
    assert!(upstream.calls().is_empty(), "nothing was dialled");
    let last = model.calls()[1]["messages"].as_array().unwrap().clone();
    let m = last.iter().find(|m| m["tool_call_id"] == "c1").unwrap();
    assert!(
        m["content"].as_str().unwrap().contains("APPROVAL_CANCELED"),
        "{m}"
    );
}

/// A held request the operator rejects: the model reads seed 004's `APPROVAL_DENIED` (the
/// approval's quorum with it), nothing is dialled, the call's run is closed, and the
/// trajectory re-plans and completes.
#[test]
fn a_rejected_http_request_is_approval_denied_and_never_dialled() {
    let d = Daemon::start_with_policy(HTTP_POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "fetch", "{\"id\": 9}"),
            scripted::answer("not allowed"),
        ],
    );
    let upstream = rt
        .block_on(Scripted::start(
            "127.0.0.2:0",
            Script {
                responses: Vec::new(),
            },
        ))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(&d, &model.base_url(), &d.data().join("effects"));
    opts.tools = vec![http_tool(
        dir.path(),
        &format!("http://{}/held", upstream.addr),
    )];
    let run = spawn_runner(&rt, opts, "traj-r");
    let out = status_becomes(&d, "traj-r", "AWAITING_APPROVAL");
    assert!(out.starts_with("traj-r AWAITING_APPROVAL "), "{out}");
    let (code, _, err) = d.cli(&["reject", "traj-r/c1", "idem:c1", "--reason", "no"]);
    assert_eq!(code, 0, "{err}");
    let runner = rt.block_on(run).unwrap();
    assert_eq!(runner.record("traj-r").unwrap().state, State::Completed);
    assert!(upstream.calls().is_empty(), "nothing was dialled");
    let last = model.calls()[1]["messages"].as_array().unwrap().clone();
    let m = last.iter().find(|m| m["tool_call_id"] == "c1").unwrap();
    let obs: serde_json::Value = serde_json::from_str(m["content"].as_str().unwrap()).unwrap();
    assert_eq!(
        (obs["status"].as_str(), obs["reason"].as_str()),
        (Some("REFUSED"), Some("APPROVAL_DENIED")),
        "{obs}"
    );
    assert_eq!(obs["quorum"], 1, "{obs}");
    assert_eq!(effect_status(&d, "traj-r/c1", "idem:c1"), "refused");
    let (code, out, err) = d.cli(&["status", "traj-r/c1", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["state"], "failed", "{v}");
}

/// A crash while the request is held: the resumed trajectory is still AWAITING_APPROVAL and
/// waits for the same effect (not admitted again as a new one); approved, it is sent once.
#[test]
fn a_trajectory_resumed_while_its_http_request_is_held_waits_for_the_same_effect() {
    let d = Daemon::start_with_policy(HTTP_POLICY, &[]);
    let server_rt = runtime();
    let model = model_server(
        &server_rt,
        vec![
            scripted::call("c1", "fetch", "{\"id\": 9}"),
            scripted::answer("done"),
        ],
    );
    let upstream = server_rt
        .block_on(Scripted::start(
            "127.0.0.2:0",
            Script {
                responses: vec![vec![Step::Status {
                    status: 200,
                    body: "sent".into(),
                }]],
            },
        ))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(&d, &model.base_url(), &d.data().join("effects"));
    opts.tools = vec![http_tool(
        dir.path(),
        &format!("http://{}/held", upstream.addr),
    )];
    let rt = runtime();
    let task = spawn_runner(&rt, opts.clone(), "traj-c");
    let out = status_becomes(&d, "traj-c", "AWAITING_APPROVAL");
    assert!(out.starts_with("traj-c AWAITING_APPROVAL "), "{out}");
    task.abort();
    rt.shutdown_timeout(Duration::from_secs(10));

    let rt = runtime();
    let mut runner = rt.block_on(async { Runner::open(opts) }).unwrap();
    let rec = runner.record("traj-c").unwrap();
    assert_eq!(rec.state, State::AwaitingApproval);
    assert_eq!(
        rec.held[0].request.as_ref().map(|r| r.key.as_str()),
        Some("idem:c1")
    );
    let run = rt.spawn(async move {
        runner.run().await.unwrap();
        runner
    });
    assert!(
        status_becomes(&d, "traj-c", "AWAITING_APPROVAL").starts_with("traj-c AWAITING_APPROVAL")
    );
    let (code, _, err) = d.cli(&["approve", "traj-c/c1", "idem:c1"]);
    assert_eq!(code, 0, "{err}");
    let runner = rt.block_on(run).unwrap();
    assert_eq!(runner.record("traj-c").unwrap().state, State::Completed);
    assert_eq!(upstream.calls(), [json!({"id": 9})], "sent exactly once");
    assert_one_request_effect(&d, "traj-c/c1");
    assert_eq!(effect_status(&d, "traj-c/c1", "idem:c1"), "completed");
}

/// The proxy starts only the effect the harness admitted: with `idem:c1` admitted for one
/// request, another request under the same key (other body, other method) is refused by the
/// gate as a mismatch and not dialled; the admitted request itself is sent, once; and one
/// under another key is admitted as its own effect under the policy (allowed: sent; held
/// for approval: not dialled — no bypass).
#[test]
fn a_request_other_than_the_preadmitted_one_is_admitted_under_policy() {
    use estop_egress::tool::{ToolProxy, ToolProxyOptions};
    let d = Daemon::start_with_policy(HTTP_POLICY, &[]);
    let rt = runtime();
    let upstream = rt
        .block_on(Scripted::start(
            "127.0.0.2:0",
            Script {
                responses: vec![
                    vec![Step::Status {
                        status: 200,
                        body: "sent".into(),
                    }],
                    vec![Step::Status {
                        status: 200,
                        body: "sent too".into(),
                    }],
                ],
            },
        ))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut egress = http_tool(dir.path(), "http://unused/").egress.unwrap();
    egress.settings.hold_ms = 200;
    let url = format!("http://{}/orders", upstream.addr);
    let body = "{\"id\": 7}";
    let mut agent = d.agent();
    let v: estop_protocol::server_line::VerdictReply = agent
        .ask(&op(
            Verb::Admit,
            json!({"run": "px", "key": "c1", "tool": "fetch", "args": {}, "start": false}),
        ))
        .unwrap();
    assert!(format!("{v:?}").contains("Admitted"), "{v:?}");
    let args = estop_egress::proxy::request_args(
        &estop_egress::proxy::HttpMethod::POST,
        &url.parse::<estop_egress::proxy::HttpUri>().unwrap(),
        body.as_bytes(),
        &egress.settings,
    )
    .unwrap();
    // As the harness does: on a connection that speaks for the call's run (`TOKEN/RUN`).
    let mut agent = estop_server::client::Client::connect(&d.socket()).unwrap();
    agent
        .request(&op(
            Verb::Hello,
            json!({"token": d.token("agent.token"), "run": "px/c1"}),
        ))
        .unwrap();
    let v: estop_protocol::server_line::VerdictReply = agent
        .ask(&op(
            Verb::Admit,
            json!({"run": "px/c1", "parent": "px", "key": "idem:c1", "tool": "http.POST",
                "args": args, "start": false}),
        ))
        .unwrap();
    assert!(format!("{v:?}").contains("Admitted"), "{v:?}");
    let proxy = rt
        .block_on(ToolProxy::start(ToolProxyOptions {
            target: d.socket(),
            token: d.token("agent.token"),
            run: "px/c1".into(),
            parent: "px".into(),
            settings: egress.settings.clone(),
            credentials: egress.credentials.clone(),
        }))
        .unwrap();
    let send = |method: &str, target: &str, key: &str, body: &str| -> String {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(proxy.addr).unwrap();
        write!(
            s,
            "{method} {target} HTTP/1.1\r\nHost: {}\r\nProxy-Authorization: Bearer {}\r\n\
             Idempotency-Key: {key}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            upstream.addr,
            proxy.secret,
            body.len()
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    let other_body = send("POST", &url, "c1", "{\"id\": 8}");
    assert!(
        other_body.starts_with("HTTP/1.1 403") && other_body.contains("mismatch"),
        "{other_body}"
    );
    let other_method = send("PUT", &url, "c1", body);
    assert!(other_method.starts_with("HTTP/1.1 403"), "{other_method}");
    assert!(upstream.calls().is_empty(), "nothing was dialled");
    let same = send("POST", &url, "c1", body);
    assert!(same.starts_with("HTTP/1.1 200"), "{same}");
    assert_eq!(upstream.calls(), [json!({"id": 7})]);
    assert_eq!(
        effect_status_becomes(&d, "px/c1", "idem:c1", "completed"),
        "completed"
    );
    // Another key: its own effect, admitted by the policy (allowed here), sent.
    let new = send("POST", &url, "c3", "{\"id\": 9}");
    assert!(new.starts_with("HTTP/1.1 200"), "{new}");
    assert_eq!(upstream.calls(), [json!({"id": 7}), json!({"id": 9})]);
    assert_eq!(
        effect_status_becomes(&d, "px/c1", "idem:c3", "completed"),
        "completed"
    );
    let held_url = format!("http://{}/held", upstream.addr);
    let other_key = send("POST", &held_url, "c2", body);
    assert!(
        other_key.starts_with("HTTP/1.1 503") && other_key.contains("\"verdict\":\"held\""),
        "{other_key}"
    );
    assert_eq!(effect_status(&d, "px/c1", "idem:c2"), "held");
    assert_eq!(upstream.calls().len(), 2, "the held one was not dialled");
    rt.block_on(proxy.finish(true));
}

/// An HTTP tool's config: PUT to a path template filled from the arguments (each value one
/// percent-encoded segment), with a static header; the upstream receives exactly that, and
/// the gate admitted it as `http.PUT` by that path. Path arguments that are missing, empty,
/// `..` or hold `/` are seed 004's `INVALID_ARGUMENTS` and never dial (nor reach the gate).
#[test]
fn an_http_tool_puts_to_its_path_template_with_static_headers_and_bad_path_arguments_never_dial() {
    // The PUT allowed by its exact path, before the deny of every other request.
    let deny = "[[rules]]\ntool = \"http.*\"\naction = \"deny\"\n";
    let put = "[[rules]]\ntool = \"http.PUT\"\nwhen = 'args.path == \"/api/orders/A%207\"'\naction = \"allow\"\n\n";
    let policy = HTTP_POLICY.replace(deny, &format!("{put}{deny}"));
    assert_ne!(policy, HTTP_POLICY);
    let d = Daemon::start_with_policy(&policy, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "fetch", "{\"order_id\": \"A 7\", \"qty\": 2}"),
            scripted::call("c2", "fetch", "{\"order_id\": \"../admin\"}"),
            scripted::call("c3", "fetch", "{\"order_id\": \"..\"}"),
            scripted::call("c4", "fetch", "{\"order_id\": \"\"}"),
            scripted::call("c5", "fetch", "{\"qty\": 2}"),
            scripted::answer("done"),
        ],
    );
    let upstream = rt
        .block_on(Scripted::start(
            "127.0.0.2:0",
            Script {
                responses: vec![vec![Step::Status {
                    status: 200,
                    body: "put".into(),
                }]],
            },
        ))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(&d, &model.base_url(), &d.data().join("effects"));
    let mut tool = http_tool(dir.path(), &format!("http://{}/api", upstream.addr));
    tool.http = estop_harness::http::HttpSpec {
        method: estop_harness::http::Method::Put,
        path: Some("/orders/{order_id}".into()),
        headers: [("X-Tenant".to_string(), "acme".to_string())].into(),
    };
    opts.tools = vec![tool];
    let runner = rt.block_on(run_to_end(opts, "traj-p"));
    assert_eq!(runner.record("traj-p").unwrap().state, State::Completed);
    assert_eq!(upstream.targets(), ["PUT /api/orders/A%207"]);
    assert_eq!(upstream.calls(), [json!({"order_id": "A 7", "qty": 2})]);
    let h = &upstream.headers()[0];
    assert!(
        h.contains(&("x-tenant".to_string(), "acme".to_string())),
        "{h:?}"
    );
    assert!(
        h.contains(&("x-api-key".to_string(), SECRET.to_string())),
        "{h:?}"
    );
    assert_eq!(effect_status(&d, "traj-p/c1", "idem:c1"), "completed");
    let (_, report, _) = d.cli(&["report", "traj-p/c1", "--json"]);
    assert!(report.contains("\"tool\":\"http.PUT\""), "{report}");
    let last = model.calls()[5]["messages"].as_array().unwrap().clone();
    for id in ["c2", "c3", "c4", "c5"] {
        let m = last.iter().find(|m| m["tool_call_id"] == id).unwrap();
        let obs: serde_json::Value = serde_json::from_str(m["content"].as_str().unwrap()).unwrap();
        assert_eq!(obs["reason"], "INVALID_ARGUMENTS", "{id}: {obs}");
        let (code, _, _) = d.cli(&["status", &format!("traj-p/{id}")]);
        assert_ne!(code, 0, "{id}: no run for a request never made");
    }
}

/// The call's run has exactly one effect, its request `idem:c1`, done.
fn assert_one_request_effect(d: &Daemon, run: &str) {
    let (_, out, _) = d.cli(&["report", run, "--json"]);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let keys = |section: &str| -> Vec<String> {
        report[section]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| format!("{} {}", e["key"], e["tool"]))
            .collect()
    };
    assert_eq!(keys("done"), ["\"idem:c1\" \"http.POST\""], "{report}");
    for section in ["held", "in_flight", "refused", "failed", "unknown"] {
        assert!(keys(section).is_empty(), "{section}: {report}");
    }
}

/// Runs `id` to its end on a runner of its own.
async fn run_to_end(opts: RunnerOptions, id: &str) -> Runner {
    let mut runner = Runner::open(opts).unwrap();
    runner.start(id, None, "go").unwrap();
    runner.run().await.unwrap();
    runner
}

/// `estop cancel` of the trajectory while its HTTP tool's request waits for the upstream's
/// answer: the gate cascades the cancel to the call's run, the proxy is fenced and cuts the
/// request (the upstream sees its client go), the request and the tool call are `unknown`,
/// the trajectory ends CANCELED, and nothing more is dialled.
#[test]
fn a_cancel_cuts_an_http_tool_request_in_flight() {
    let d = Daemon::start_with_policy(HTTP_POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "fetch", "{\"id\": 10}"),
            // The proxy may hear the cascaded cancel (and cut the request) before the runner
            // hears it: the cut result can reach the trajectory first, which then calls the
            // model once more — a call the cancel cuts when it lands (held open here so it
            // cannot finish first).
            vec![scripted::text("never"), Step::Gate, Step::Done],
        ],
    );
    let upstream = rt
        .block_on(Scripted::start(
            "127.0.0.2:0",
            Script {
                responses: vec![vec![scripted::text("partial"), Step::Gate, Step::Done]],
            },
        ))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(&d, &model.base_url(), &d.data().join("effects"));
    opts.tools = vec![http_tool(
        dir.path(),
        &format!("http://{}/orders", upstream.addr),
    )];
    let run = spawn_runner(&rt, opts, "traj-8");
    rt.block_on(upstream.wait_for(&Seen::Call { n: 0 }));
    let (code, _, err) = d.cli(&["cancel", "traj-8", "--reason", "stop it"]);
    assert_eq!(code, 0, "{err}");
    let runner = rt.block_on(run).unwrap();
    assert_eq!(runner.record("traj-8").unwrap().state, State::Canceled);
    rt.block_on(upstream.wait_for(&Seen::Gone { n: 0, step: 1 }));
    assert_eq!(upstream.calls().len(), 1, "nothing dialled after the fence");
    assert!(model.calls().len() <= 2);
    assert_eq!(effect_status(&d, "traj-8", "c1"), "unknown");
    assert_eq!(
        effect_status_becomes(&d, "traj-8/c1", "idem:c1", "unknown"),
        "unknown"
    );
    let (_, status, _) = d.cli(&["status", "traj-8/c1", "--json"]);
    assert!(status.contains("cancelled"), "{status}");
}

/// A trajectory started under a parent run (a sub-agent): the gate's cancel of the parent
/// cascades to the trajectory's run, and the trajectory stops — its open stream cut — though
/// nobody cancelled it by name.
#[test]
fn a_parents_cancel_reaches_a_sub_agent_trajectory() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let rt = runtime();
    let script = Script {
        responses: vec![
            scripted::call("c1", "lookup", "{}"),
            vec![
                scripted::text("thinking"),
                Step::Gate,
                scripted::finish("stop"),
                Step::Done,
            ],
        ],
    };
    let server = model_server(&rt, script.responses);
    // The parent: a run of the same agent, created by its first admission.
    let mut agent = d.agent();
    agent
        .request(&op(
            Verb::Admit,
            json!({"run": "parent-1", "key": "k", "tool": "lookup", "args": {}}),
        ))
        .unwrap();
    let opts = options(&d, &server.base_url(), &d.data().join("effects"));
    let mut runner = rt.block_on(async { Runner::open(opts) }).unwrap();
    rt.block_on(async { runner.start("child-1", Some("parent-1"), "help the parent") })
        .unwrap();
    let run = rt.spawn(async move {
        runner.run().await.unwrap();
        runner
    });
    rt.block_on(server.wait_for(&Seen::Call { n: 1 }));
    let (code, _, err) = d.cli(&["cancel", "parent-1", "--reason", "the parent is done"]);
    assert_eq!(code, 0, "{err}");
    let runner = rt.block_on(run).unwrap();
    let rec = runner.record("child-1").unwrap();
    assert_eq!(rec.state, State::Canceled);
    assert_eq!(rec.identity.parent.as_deref(), Some("parent-1"));
    rt.block_on(server.wait_for(&Seen::Gone { n: 1, step: 1 }));
    let (_, out, _) = d.cli(&["status", "child-1", "--json"]);
    assert!(out.contains("parent-1"), "{out}");
}

/// The runner options of the sub-agent tests: the lookup tool and the `delegate` tool, with
/// `sub`'s bounds, under 10 turns.
fn sub_options(d: &Daemon, model: &str, sub: Subagents) -> RunnerOptions {
    let mut opts = options(d, model, &d.data().join("effects"));
    opts.tools.truncate(1);
    opts.tools.push(sub.tool());
    opts.subagents = Some(sub);
    opts
}

/// The messages of the model's `n`-th call.
fn messages(model: &Scripted, n: usize) -> Vec<serde_json::Value> {
    model.calls()[n]["messages"].as_array().unwrap().clone()
}

/// A trajectory starts a sub-agent with `delegate`: the child `PARENT/CALL` is a trajectory of
/// its own (its own context, its tool calls under its own run, a child of the parent's, even
/// with a call id its parent used), its budget carved from what the parent had left; the
/// parent waits, reads the child's answer as the call's result, and its spend includes the
/// child's. The exact call sequence: parent, child, child, parent.
#[test]
fn a_trajectory_delegates_to_a_sub_agent_and_reads_its_answer() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "delegate", "{\"task\": \"count the rows\"}"),
            scripted::call("c1", "lookup", "{\"table\": \"orders\"}"),
            scripted::answer("3 rows"),
            scripted::answer("the sub-agent counted 3 rows"),
        ],
    );
    let opts = sub_options(&d, &model.base_url(), Subagents::default());
    let run = spawn_runner(&rt, opts, "sa-1");
    let runner = rt.block_on(run).unwrap();
    let parent = runner.record("sa-1").unwrap();
    assert_eq!(parent.state, State::Completed);
    let child = runner
        .record("sa-1/c1")
        .expect("the sub-agent's trajectory");
    assert_eq!(child.state, State::Completed);
    assert_eq!(
        (
            child.identity.parent.as_deref(),
            child.identity.depth,
            child.identity.spawned_by.as_deref()
        ),
        (Some("sa-1"), 1, Some("c1"))
    );
    assert_eq!(child.identity.task, "count the rows");
    // Half of the 9 turns left when the parent delegated.
    assert_eq!(child.budget.limits.turns_max, Some(4));
    assert_eq!(child.budget.spend.turns, 2);
    assert_eq!(parent.budget.spend.turns, 4, "its own 2 and the child's 2");
    assert!(parent.budget.carved.is_empty());
    assert_eq!(model.calls().len(), 4);
    let child_first = messages(&model, 1);
    assert_eq!(
        child_first.len(),
        2,
        "the child's own context: {child_first:?}"
    );
    assert_eq!(child_first[1]["content"], "count the rows");
    let last = messages(&model, 3);
    let obs = last.iter().find(|m| m["tool_call_id"] == "c1").unwrap();
    assert_eq!(obs["content"], "3 rows");
    assert_eq!(effect_status(&d, "sa-1", "c1"), "completed");
    assert_eq!(effect_status(&d, "sa-1/c1", "c1"), "completed");
    let (_, status, _) = d.cli(&["status", "sa-1/c1", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(
        (v["parent"].as_str(), v["state"].as_str()),
        (Some("sa-1"), Some("completed")),
        "{v}"
    );
}

/// A parent's `estop agent status` (and `--json`) shows its sub-agents while they work: the
/// child `PARENT/CALL_ID` with its state, turns and spend against its own ceilings; the
/// console's trajectory page has them too (`children`).
#[test]
fn a_parents_status_shows_its_sub_agents_progress() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "delegate", "{\"task\": \"count the rows\"}"),
            vec![
                scripted::text("counting"),
                Step::Gate,
                scripted::finish("stop"),
                Step::Done,
            ],
            scripted::answer("the sub-agent counted"),
        ],
    );
    let opts = sub_options(&d, &model.base_url(), Subagents::default());
    let run = spawn_runner(&rt, opts, "sa-s");
    rt.block_on(model.wait_for(&Seen::Call { n: 1 }));
    let (code, out, err) = d.cli(&["agent", "status", "sa-s"]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[0].starts_with("sa-s WAITING_TOOL turns=1/10"),
        "{out}"
    );
    assert_eq!(
        lines.last().copied(),
        Some("child sa-s/c1 CALLING_MODEL turns=1/4 tokens=0 usd_micros=0"),
        "{out}"
    );
    let (code, out, err) = d.cli(&["agent", "status", "sa-s", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["children_count"], 1, "{v}");
    let child = &v["children"][0];
    assert_eq!(
        (
            child["id"].as_str(),
            child["state"].as_str(),
            child["turns"].as_u64()
        ),
        (Some("sa-s/c1"), Some("CALLING_MODEL"), Some(1)),
        "{v}"
    );
    assert_eq!(child["limits"]["turns_max"], 4);
    let view = estop_harness::view::one(
        &d.data().join("harness/journal"),
        "sa-s",
        estop_harness::runner::now_ms(),
        &Default::default(),
    )
    .unwrap()
    .unwrap();
    assert_eq!(view["children"][0]["id"], "sa-s/c1", "{view}");
    model.release(1);
    let runner = rt.block_on(run).unwrap();
    assert_eq!(runner.record("sa-s").unwrap().state, State::Completed);
}

/// Sub-agents are bounded: past `children_max` and `depth_max` the model reads a typed
/// refusal (SUBAGENT_LIMIT, SUBAGENT_DEPTH) and no trajectory is started.
#[test]
fn sub_agents_are_bounded_in_count_and_depth() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let rt = runtime();
    let two = vec![
        scripted::tool_start(0, "c1", "delegate", "{\"task\": \"one\"}"),
        scripted::tool_start(1, "c2", "delegate", "{\"task\": \"two\"}"),
        scripted::finish("tool_calls"),
        scripted::usage(30, 0, 8),
        Step::Done,
    ];
    let model = model_server(
        &rt,
        vec![
            two,
            scripted::call("d1", "delegate", "{\"task\": \"deeper\"}"),
            scripted::answer("did it myself"),
            scripted::answer("one done, two refused"),
        ],
    );
    let sub = Subagents {
        depth_max: 1,
        children_max: 1,
        ..Subagents::default()
    };
    let run = spawn_runner(&rt, sub_options(&d, &model.base_url(), sub), "sa-2");
    let runner = rt.block_on(run).unwrap();
    assert_eq!(runner.record("sa-2").unwrap().state, State::Completed);
    let started: Vec<&str> = ["sa-2/c1", "sa-2/c2"]
        .into_iter()
        .filter(|c| runner.record(c).is_some())
        .collect();
    assert_eq!(started.len(), 1, "one sub-agent of the two: {started:?}");
    assert!(runner.record(&format!("{}/d1", started[0])).is_none());
    assert_eq!(model.calls().len(), 4);
    let reason = |msgs: &[serde_json::Value], id: &str| -> String {
        let m = msgs.iter().find(|m| m["tool_call_id"] == id).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(m["content"].as_str().unwrap()).unwrap_or_default();
        v["reason"].as_str().unwrap_or_default().to_string()
    };
    assert_eq!(reason(&messages(&model, 2), "d1"), "SUBAGENT_DEPTH");
    let refused = if started[0] == "sa-2/c1" { "c2" } else { "c1" };
    let last = messages(&model, 3);
    assert_eq!(reason(&last, refused), "SUBAGENT_LIMIT");
    let answered = last
        .iter()
        .find(|m| m["tool_call_id"] != refused && m["role"] == "tool")
        .unwrap();
    assert_eq!(answered["content"], "did it myself");
}

/// At the restrict stage (90%) the sub-agent tool is taken away: the model is not offered it,
/// and a call to it anyway is refused NOT_GRANTED; no sub-agent starts.
#[test]
fn no_sub_agent_starts_at_the_restrict_stage() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let rt = runtime();
    let heavy = vec![
        scripted::tool_start(0, "c1", "lookup", "{}"),
        scripted::finish("tool_calls"),
        scripted::usage(900, 0, 5),
        Step::Done,
    ];
    let light = vec![
        scripted::tool_start(0, "c2", "delegate", "{\"task\": \"more\"}"),
        scripted::finish("tool_calls"),
        scripted::usage(1, 0, 1),
        Step::Done,
    ];
    let model = model_server(&rt, vec![heavy, light, scripted::answer("stopping")]);
    let mut opts = sub_options(&d, &model.base_url(), Subagents::default());
    opts.limits.tokens_max = Some(1_000);
    let run = spawn_runner(&rt, opts, "sa-3");
    let runner = rt.block_on(run).unwrap();
    assert!(runner.record("sa-3/c2").is_none(), "no sub-agent started");
    let offered: Vec<String> = model.calls()[1]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        offered,
        ["lookup"],
        "only the read-only tool is offered at 90%"
    );
    let ctx = runner.context("sa-3");
    let obs = ctx
        .iter()
        .find(|m| m.tool_call_id.as_deref() == Some("c2"))
        .unwrap();
    assert!(
        obs.content.as_deref().unwrap().contains("NOT_GRANTED"),
        "{obs:?}"
    );
}

/// A cancel of the parent cascades to its sub-agent (whose stream is cut, though it never
/// made a gate run of its own); an interrupt of the parent does not: the sub-agent finishes
/// undisturbed and the parent takes the new message at its next boundary.
#[test]
fn a_parents_cancel_cascades_to_its_sub_agent_and_an_interrupt_does_not() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let rt = runtime();
    let gated_answer = vec![
        scripted::text("3 rows"),
        Step::Gate,
        scripted::finish("stop"),
        scripted::usage(20, 0, 5),
        Step::Done,
    ];
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "delegate", "{\"task\": \"count\"}"),
            gated_answer.clone(),
            scripted::answer("ok, using the replica"),
            scripted::call("c1", "delegate", "{\"task\": \"count again\"}"),
            gated_answer,
        ],
    );
    let opts = sub_options(&d, &model.base_url(), Subagents::default());
    let mut runner = rt.block_on(async { Runner::open(opts) }).unwrap();
    let inputs = runner.inputs();
    rt.block_on(async { runner.start("sa-4", None, "count") })
        .unwrap();
    let run = rt.spawn(async move {
        runner.run().await.unwrap();
        runner
    });
    rt.block_on(model.wait_for(&Seen::Call { n: 1 }));
    let message = "use the replica".to_string();
    inputs
        .send(Input::Control {
            id: "sa-4".into(),
            control: Control::Interrupt { message },
        })
        .unwrap();
    model.release(1);
    let runner = rt.block_on(run).unwrap();
    assert_eq!(runner.record("sa-4").unwrap().state, State::Completed);
    assert_eq!(runner.record("sa-4/c1").unwrap().state, State::Completed);
    assert!(
        !model.seen().contains(&Seen::Gone { n: 1, step: 1 }),
        "the sub-agent's stream was not cut"
    );
    let last = messages(&model, 2);
    assert_eq!(
        last.iter().find(|m| m["tool_call_id"] == "c1").unwrap()["content"],
        "3 rows"
    );
    assert_eq!(last.last().unwrap()["content"], "use the replica");
    drop(runner);

    // The cancel: the sub-agent's open stream is cut and both end CANCELED.
    let opts = sub_options(&d, &model.base_url(), Subagents::default());
    let mut runner = rt.block_on(async { Runner::open(opts) }).unwrap();
    rt.block_on(async { runner.start("sa-5", None, "count") })
        .unwrap();
    let run = rt.spawn(async move {
        runner.run().await.unwrap();
        runner
    });
    rt.block_on(model.wait_for(&Seen::Call { n: 4 }));
    let (code, _, err) = d.cli(&["cancel", "sa-5", "--reason", "enough"]);
    assert_eq!(code, 0, "{err}");
    let runner = rt.block_on(run).unwrap();
    assert_eq!(runner.record("sa-5").unwrap().state, State::Canceled);
    assert_eq!(runner.record("sa-5/c1").unwrap().state, State::Canceled);
    rt.block_on(model.wait_for(&Seen::Gone { n: 4, step: 1 }));
    assert_eq!(model.calls().len(), 5, "no call after the cancel");
    assert_eq!(effect_status(&d, "sa-5", "c1"), "unknown");
}

/// At the budget's steer stage the context sent is compacted without a model call: the tool
/// results before the last three turns become markers naming their size and the journal, the
/// system prompt, the task, every assistant message and the last turns stay as they were, and
/// every tool call keeps the tool message answering it. The boundary is a record fact: a crash
/// during the steered call resumes and sends exactly the same request; the journal keeps every
/// result whole.
#[test]
fn at_the_steer_stage_old_tool_results_are_sent_compacted_and_a_resume_sends_the_same() {
    use estop_harness::compact::marker;
    let d = Daemon::start_with_policy(POLICY, &[]);
    let server_rt = runtime();
    let args = |i: usize| format!("{{\"q\": \"{}\"}}", format!("r{i}-").repeat(100));
    let mut responses: Vec<Vec<Step>> = (1..=7)
        .map(|i| scripted::call(&format!("c{i}"), "lookup", &args(i)))
        .collect();
    responses.push(vec![Step::Gate, Step::Done]);
    responses.push(scripted::answer("done"));
    let model = model_server(&server_rt, responses);
    let opts = options(&d, &model.base_url(), &d.data().join("effects"));
    let rt = runtime();
    let mut runner = rt.block_on(async { Runner::open(opts.clone()) }).unwrap();
    rt.block_on(async { runner.start("cp-1", None, "look it all up") })
        .unwrap();
    let task = rt.spawn(async move { runner.run().await });
    // The eighth call is the first at 70% of the ten turns: the stream waits at its gate.
    server_rt.block_on(model.wait_for(&Seen::Call { n: 7 }));
    task.abort();
    rt.shutdown_timeout(Duration::from_secs(10));

    let rt = runtime();
    let mut runner = rt.block_on(async { Runner::open(opts) }).unwrap();
    let runner = rt.block_on(async move {
        runner.run().await.unwrap();
        runner
    });
    assert_eq!(runner.record("cp-1").unwrap().state, State::Completed);
    assert_eq!(model.calls().len(), 9);
    let notice = |m: &serde_json::Value| {
        m["role"] == "system" && m["content"].as_str().unwrap().starts_with("Budget notice")
    };
    for n in 0..7 {
        let sent = messages(&model, n);
        assert!(
            !sent.iter().any(notice),
            "call {n} is before the steer stage"
        );
        assert!(
            !sent.iter().any(|m| m["content"]
                .as_str()
                .is_some_and(|c| c.contains("[compacted"))),
            "call {n} is sent whole"
        );
    }
    let before = messages(&model, 6);
    let steered = messages(&model, 7);
    assert!(notice(steered.last().unwrap()), "{:?}", steered.last());
    // system, task, then (assistant cN, tool cN) for N in 1..=7, then the notice.
    assert_eq!(steered.len(), 2 + 14 + 1);
    assert_eq!(steered[0]["role"], "system");
    assert_eq!(
        steered[1],
        json!({"role": "user", "content": "look it all up"})
    );
    for (i, m) in steered.iter().enumerate().take(16) {
        if m["role"] != "tool" {
            // (c7's call is new in this request)
            assert!(i == 14 || Some(m) == before.get(i), "message {i} as it was");
            continue;
        }
        let n = (i - 1) / 2; // the call cN this result answers
        assert_eq!(m["tool_call_id"], format!("c{n}"));
        assert_eq!(steered[i - 1]["tool_calls"][0]["id"], format!("c{n}"));
        let full = args(n);
        if n <= 4 {
            assert_eq!(
                m["content"],
                marker(full.len(), i),
                "c{n} is before the last 3 turns"
            );
        } else {
            assert_eq!(m["content"], full, "c{n} is in the last 3 turns");
        }
    }
    // The call lost in the crash counts as a turn: only the notice's figure differs.
    let resumed = messages(&model, 8);
    assert!(notice(resumed.last().unwrap()), "{:?}", resumed.last());
    assert!(
        resumed[..16] == steered[..16],
        "the resumed call sends the same context"
    );
    let journal = runner.context("cp-1");
    assert_eq!(
        journal[3].content.as_deref(),
        Some(args(1).as_str()),
        "the journal keeps it whole"
    );
    assert_eq!(runner.record("cp-1").unwrap().pointers.compacted_before, 10);
}

/// A crash while the sub-agent's model call is in flight: the reopened runner resumes the
/// parent (still waiting for its call) and the child from the journal, and never starts the
/// sub-agent twice; the child's call is made again and its answer reaches the parent.
#[test]
fn a_resumed_parent_does_not_start_its_sub_agent_twice() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let server_rt = runtime();
    let model = model_server(
        &server_rt,
        vec![
            scripted::call("c1", "delegate", "{\"task\": \"count\"}"),
            vec![scripted::text("3"), Step::Gate, Step::Done],
            scripted::answer("3 rows"),
            scripted::answer("the sub-agent counted 3 rows"),
        ],
    );
    let opts = sub_options(&d, &model.base_url(), Subagents::default());
    let rt = runtime();
    let mut runner = rt.block_on(async { Runner::open(opts.clone()) }).unwrap();
    rt.block_on(async { runner.start("sa-6", None, "count") })
        .unwrap();
    let task = rt.spawn(async move { runner.run().await });
    server_rt.block_on(model.wait_for(&Seen::Call { n: 1 }));
    task.abort();
    rt.shutdown_timeout(Duration::from_secs(10));

    let rt = runtime();
    let mut runner = rt.block_on(async { Runner::open(opts) }).unwrap();
    assert_eq!(runner.record("sa-6").unwrap().state, State::WaitingTool);
    assert_eq!(runner.record("sa-6/c1").unwrap().state, State::CallingModel);
    let runner = rt.block_on(async move {
        runner.run().await.unwrap();
        runner
    });
    assert_eq!(runner.record("sa-6").unwrap().state, State::Completed);
    assert_eq!(runner.record("sa-6/c1").unwrap().state, State::Completed);
    let calls = model.calls();
    assert_eq!(
        calls.len(),
        4,
        "parent, child (cut by the crash), child again, parent"
    );
    assert_eq!(
        messages(&model, 2).len(),
        2,
        "the child's own context, once"
    );
    let last = messages(&model, 3);
    let results: Vec<_> = last.iter().filter(|m| m["tool_call_id"] == "c1").collect();
    assert_eq!(results.len(), 1);
    assert_eq!(results[0]["content"], "3 rows");
    assert_eq!(effect_status(&d, "sa-6", "c1"), "completed");
}

/// A trajectory holds a workspace lease: `ROOT/ID`, made when it starts and journalled with
/// its record, where its command tools run (`ESTOP_WORKSPACE`); FINALIZING releases it — the
/// lease leaves the record, the directory is kept with what the tools left, read-only.
#[test]
fn a_trajectorys_workspace_lease_is_released_at_finalizing() {
    use std::os::unix::fs::PermissionsExt;
    let d = Daemon::start_with_policy(POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "lookup", "{}"),
            scripted::answer("wrote out.txt"),
        ],
    );
    let root = tempfile::tempdir().unwrap();
    let mut opts = options(&d, &model.base_url(), &d.data().join("effects"));
    opts.workspaces = Some(root.path().to_path_buf());
    opts.tools[0].command = vec![
        "sh".into(),
        "-c".into(),
        "echo partial > out.txt; echo \"$ESTOP_WORKSPACE\"; pwd".into(),
    ];
    let mut runner = rt.block_on(async { Runner::open(opts) }).unwrap();
    rt.block_on(async { runner.start("ws-1", None, "write it") })
        .unwrap();
    let held = runner.record("ws-1").unwrap().clone();
    let dir = root.path().join("ws-1");
    assert_eq!(held.leases.len(), 1, "leased at the start");
    assert_eq!(held.leases[0].kind, "workspace");
    assert_eq!(
        held.pointers.workspace.as_deref(),
        Some(dir.to_str().unwrap())
    );
    let runner = rt.block_on(async move {
        runner.run().await.unwrap();
        runner
    });
    let rec = runner.record("ws-1").unwrap();
    assert_eq!(rec.state, State::Completed);
    assert!(rec.leases.is_empty(), "released at FINALIZING");
    let last = messages(&model, 1);
    let obs = last.iter().find(|m| m["tool_call_id"] == "c1").unwrap();
    let here = dir.display().to_string();
    assert_eq!(
        obs["content"],
        format!("{here}\n{here}\n"),
        "the tool ran in it"
    );
    let out = dir.join("out.txt");
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        "partial\n",
        "partial work kept"
    );
    let writable =
        |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o222 != 0;
    common::poll(Duration::from_secs(10), Duration::from_millis(20), || {
        (!writable(&out) && !writable(&dir), ())
    });
    assert!(
        !writable(&out) && !writable(&dir),
        "read-only once released"
    );
    // The tempdir's cleanup needs the write bit back.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
}

/// The contract's `workspace_files`, as the runner sees the workspace lease when the model
/// ends: an answer before the tool wrote `report.md` gets the notice turn naming the file; the
/// model calls the tool (which writes it there), answers again and completes — three model
/// calls, and the check in the record lists the file check as passed.
#[test]
fn a_contracts_workspace_file_is_looked_for_in_the_workspace_lease() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::answer("done"),
            scripted::call("c1", "lookup", "{}"),
            scripted::answer("done, see report.md"),
        ],
    );
    let root = tempfile::tempdir().unwrap();
    let mut opts = options(&d, &model.base_url(), &d.data().join("effects"));
    opts.workspaces = Some(root.path().to_path_buf());
    opts.tools[0].command = vec!["sh".into(), "-c".into(), "echo hi > report.md".into()];
    opts.contract = Some(estop_harness::contract::Contract {
        workspace_files: vec!["report.md".into()],
        ..Default::default()
    });
    let runner = rt.block_on(spawn_runner(&rt, opts, "wf-1")).unwrap();
    let rec = runner.record("wf-1").unwrap();
    assert_eq!(rec.state, State::Completed);
    let check = rec.check.as_ref().unwrap();
    assert!(check.passed && check.notices == 1, "{check:?}");
    assert!(check.checked.contains(&"workspace_files".to_string()));
    let calls = model.calls();
    assert_eq!(calls.len(), 3);
    let second = calls[1]["messages"].as_array().unwrap();
    let notice = second.last().unwrap()["content"].as_str().unwrap();
    assert!(
        notice.starts_with("[completion check failed: workspace_files:")
            && notice.contains("report.md"),
        "{notice}"
    );
    // The tempdir's cleanup needs the write bit back once the released workspace was made
    // read-only.
    use std::os::unix::fs::PermissionsExt;
    let dir = root.path().join("wf-1");
    common::poll(Duration::from_secs(10), Duration::from_millis(20), || {
        (
            std::fs::metadata(&dir).unwrap().permissions().mode() & 0o222 == 0,
            (),
        )
    });
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
}

/// Starts `id` on a runner of its own and returns the task driving it.
fn spawn_runner(
    rt: &tokio::runtime::Runtime,
    opts: RunnerOptions,
    id: &str,
) -> tokio::task::JoinHandle<Runner> {
    let mut runner = rt.block_on(async { Runner::open(opts) }).unwrap();
    rt.block_on(async { runner.start(id, None, "clean up staging") })
        .unwrap();
    rt.spawn(async move {
        runner.run().await.unwrap();
        runner
    })
}

/// `estop agent interrupt` from another process while the model streams: the request is
/// stored (the command returns once it is durable), the stream is cut, and at the next
/// boundary the model sees the cut marker and then the new user message; the trajectory goes
/// on with it and completes. An agent token may not interrupt, an empty message is bad input,
/// and neither changes anything. `estop agent status` shows the live record.
#[test]
fn an_interrupt_from_another_terminal_lands_at_the_next_boundary() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let effects = d.data().join("effects");
    let rt = runtime();
    let server = model_server(
        &rt,
        vec![
            vec![
                scripted::text("Dropping orders_staging now"),
                Step::Gate,
                scripted::finish("stop"),
                Step::Done,
            ],
            scripted::answer("used the replica"),
        ],
    );
    let mut opts = options(&d, &server.base_url(), &effects);
    // Without the interrupt's cut, the open call would end only at its deadline.
    opts.call_limits.call_deadline_ms = 5_000;
    let run = spawn_runner(&rt, opts, "traj-i");
    rt.block_on(server.wait_for(&Seen::Call { n: 0 }));

    use std::os::unix::fs::PermissionsExt;
    let sock = std::fs::metadata(d.data().join("harness/control.sock")).unwrap();
    assert_eq!(
        sock.permissions().mode() & 0o777,
        0o600,
        "only its owner connects"
    );
    let (code, out, err) = d.cli(&["agent", "status", "traj-i"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("traj-i CALLING_MODEL turns=1/10"), "{out}");
    let agent = d.token("agent.token");
    let (code, _, err) = d.cli(&["agent", "interrupt", "traj-i", "no", "--token", &agent]);
    assert_eq!(code, 1);
    assert!(err.contains("forbidden"), "{err}");
    let (code, _, err) = d.cli(&["agent", "interrupt", "traj-i", "no", "--token", "forged"]);
    assert_eq!(code, 1);
    assert!(err.contains("unauthenticated"), "{err}");
    let (code, _, err) = d.cli(&["agent", "interrupt", "traj-i", " "]);
    assert_eq!(code, 1);
    assert!(err.contains("bad_request"), "{err}");
    let (code, _, err) = d.cli(&["agent", "interrupt", "nope", "x"]);
    assert_eq!(code, 1);
    assert!(err.contains("unknown_trajectory"), "{err}");
    assert!(
        !server.seen().contains(&Seen::Gone { n: 0, step: 1 }),
        "the refused requests did not cut the stream"
    );

    let (code, out, err) = d.cli(&["agent", "interrupt", "traj-i", "use the replica instead"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("stored; traj-i is"), "{out}");
    let runner = rt.block_on(run).unwrap();
    let rec = runner.record("traj-i").unwrap();
    assert_eq!(rec.state, State::Completed);
    rt.block_on(server.wait_for(&Seen::Gone { n: 0, step: 1 }));
    let calls = server.calls();
    assert_eq!(calls.len(), 2);
    let msgs: Vec<_> = calls[1]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect();
    assert_eq!(
        &msgs[msgs.len() - 2..],
        &[
            (
                "user",
                "[interrupted: the reply was cut by a control request]"
            ),
            ("user", "use the replica instead"),
        ],
        "{msgs:?}"
    );
    assert_eq!(
        msgs.iter()
            .filter(|m| m.1 == "use the replica instead")
            .count(),
        1
    );
    drop(runner);
    let (code, _, err) = d.cli(&["agent", "status", "traj-i"]);
    assert_eq!(code, 1, "no runner listens once it is gone");
    assert!(err.contains("no runner is listening"), "{err}");
}

/// `estop agent budget` lowers a running trajectory's turn ceiling while its first call
/// streams: stored, applied at the next boundary, where the spend already meets it — the
/// trajectory ends FAILED with BUDGET_EXCEEDED naming `turns`, the dimensions not given kept.
#[test]
fn a_budget_change_from_another_terminal_applies_at_the_next_boundary() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let effects = d.data().join("effects");
    let rt = runtime();
    let server = model_server(
        &rt,
        vec![
            vec![Step::Gate, scripted::text("thinking"), Step::Done],
            scripted::answer("never asked"),
        ],
    );
    let mut opts = options(&d, &server.base_url(), &effects);
    opts.call_limits.call_deadline_ms = 5_000;
    opts.limits.tokens_max = Some(50_000);
    let run = spawn_runner(&rt, opts, "traj-b");
    rt.block_on(server.wait_for(&Seen::Call { n: 0 }));
    let (code, _, err) = d.cli(&["agent", "budget", "traj-b"]);
    assert_eq!(code, 1, "nothing to change is bad input");
    assert!(err.contains("bad_request"), "{err}");
    let (code, _, err) = d.cli(&["agent", "budget", "traj-b", "--usd=-1"]);
    assert_eq!(code, 1);
    assert!(err.contains("not an amount"), "{err}");
    let (code, out, err) = d.cli(&["agent", "budget", "traj-b", "--turns", "1"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("stored"), "{out}");
    let runner = rt.block_on(run).unwrap();
    let rec = runner.record("traj-b").unwrap();
    assert_eq!(rec.state, State::Failed);
    assert!(
        matches!(&rec.exit, Some(Exit::BudgetExceeded { dimension }) if format!("{dimension:?}").to_lowercase().contains("turns")),
        "{:?}",
        rec.exit
    );
    assert_eq!(rec.budget.limits.turns_max, Some(1));
    assert_eq!(rec.budget.limits.tokens_max, Some(50_000), "kept");
    assert_eq!(server.calls().len(), 1, "no call past the new ceiling");
}

/// The threads of this process (`/proc/self/status`).
fn threads() -> usize {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// 200 trajectories wait for an approval at once: their subscriptions and approval waits share
/// one connection and no thread of their own (the threads of the process stay under 64; a
/// thread per subscription and per wait made it over 400), and once an operator approves, each
/// call runs once and every trajectory completes.
#[test]
fn many_trajectories_waiting_for_approval_hold_no_thread_each() {
    const N: usize = 200;
    let d = Daemon::start_with_policy(POLICY, &[]);
    let effects = d.data().join("effects");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(16)
        .enable_all()
        .build()
        .unwrap();
    let mut responses = vec![scripted::call("c1", "drop_table", "{}"); N];
    responses.extend(vec![scripted::answer("done"); N]);
    let server = model_server(&rt, responses);
    let mut op_client = d.operator();
    for i in 0..N {
        op_client
            .request(&op(Verb::Subscribe, json!({"run": format!("m-{i}")})))
            .unwrap();
    }
    let mut runner = rt
        .block_on(async { Runner::open(options(&d, &server.base_url(), &effects)) })
        .unwrap();
    for i in 0..N {
        rt.block_on(async { runner.start(&format!("m-{i}"), None, "drop it") })
            .unwrap();
    }
    let run = rt.spawn(async move {
        runner.run().await.unwrap();
        runner
    });
    let mut held = 0;
    while held < N {
        if let Some(e) = op_client.next_event().unwrap() {
            held += usize::from(e.event == EventKind::Held);
        }
    }
    let t = threads();
    assert!(t < 64, "{t} threads with {N} trajectories waiting");
    for i in 0..N {
        let decide = json!({"run": format!("m-{i}"), "key": "c1", "decision": "approve"});
        op_client.request(&op(Verb::Decide, decide)).unwrap();
    }
    // A bound against a hang only (a lost decision would wait forever), not a timed assertion.
    let runner = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(120), run).await })
        .expect("every trajectory ends")
        .unwrap();
    for i in 0..N {
        let rec = runner.record(&format!("m-{i}")).unwrap();
        assert_eq!(rec.state, State::Completed, "m-{i}");
    }
    let ran = std::fs::read_to_string(&effects).unwrap();
    assert_eq!(ran.lines().count(), N, "each approved call ran once");
}

/// A small MCP server on stdio (newline-delimited JSON-RPC), for the harness's MCP tools: it
/// logs every call and every `notifications/cancelled` it receives to `$LOG`. Tools: `echo`
/// and `write` answer `NAME: TEXT`; `block` writes `started` to the fifo `$STARTED` and never
/// answers; `die` exits mid-call. Python, as the egress tests use it: a real MCP peer that is
/// not rmcp, so the harness's client is tested against another implementation.
const MCP_SERVER: &str = r#"
import json, os, sys
def log(line):
    with open(os.environ["LOG"], "a") as f:
        f.write(line + "\n")
def send(msg):
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()
schema = {"type": "object", "properties": {"text": {"type": "string"}}}
tools = [{"name": n, "description": "the " + n + " tool", "inputSchema": schema}
         for n in ["echo", "write", "block", "die"]]
tools[0]["annotations"] = {"readOnlyHint": True}
for line in sys.stdin:
    msg = json.loads(line)
    method, mid = msg.get("method"), msg.get("id")
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": mid, "result": {
            "protocolVersion": msg["params"]["protocolVersion"],
            "capabilities": {"tools": {}}, "serverInfo": {"name": "py", "version": "1"}}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": mid, "result": {"tools": tools}})
    elif method == "tools/call":
        name = msg["params"]["name"]
        text = msg["params"].get("arguments", {}).get("text", "")
        log("call %s %s" % (name, text))
        if name == "die":
            os._exit(3)
        if name == "block":
            with open(os.environ["STARTED"], "w") as f:
                f.write("started\n")
            continue
        send({"jsonrpc": "2.0", "id": mid, "result": {
            "content": [{"type": "text", "text": "%s: %s" % (name, text)}]}})
    elif method == "notifications/cancelled":
        log("cancelled %s" % msg["params"].get("requestId"))
    elif mid is not None:
        send({"jsonrpc": "2.0", "id": mid, "result": {}})
"#;

/// The scripted model server, serving `responses` in order.
fn model_server(rt: &tokio::runtime::Runtime, responses: Vec<Vec<Step>>) -> Scripted {
    rt.block_on(Scripted::start("127.0.0.1:0", Script { responses }))
        .unwrap()
}

/// The agent config of the MCP tests: the scripted model and the Python server as `files`.
fn mcp_config(d: &Daemon, model: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let (server, log) = (d.data().join("mcp.py"), d.data().join("mcp.log"));
    std::fs::write(&server, MCP_SERVER).unwrap();
    let started = d.data().join("started");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&started)
            .status()
            .unwrap()
            .success()
    );
    let config = d.data().join("agent.toml");
    let text = format!(
        r#"
[[model]]
name = "scripted"
base_url = "{model}"
usd_per_mtok_input = 3.0
usd_per_mtok_output = 15.0

[budget]
turns = 6

[[server]]
name = "files"
command = "python3"
args = ["-u", {server:?}]
env = {{ LOG = {log:?}, STARTED = {started:?} }}
"#,
        server = server.display().to_string(),
        log = log.display().to_string(),
        started = started.display().to_string(),
    );
    std::fs::write(&config, text).unwrap();
    (config, log)
}

const MCP_POLICY: &str = r#"
[defaults]
unknown_tool = "allow"

[[rules]]
tool = "files__write"
action = "deny"
"#;

/// MCP tools end to end: the server's tools are offered to the model as `server__tool`; a call
/// the gate admits is sent upstream and its answer observed; a call the gate refuses never
/// reaches the server; an upstream that dies mid-call leaves that call `unknown` at the gate,
/// and the trajectory goes on.
#[test]
fn mcp_tools_are_admitted_by_the_gate_then_sent_upstream() {
    let d = Daemon::start_with_policy(MCP_POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "files__echo", "{\"text\": \"hi\"}"),
            scripted::call("c2", "files__write", "{\"text\": \"rm -rf\"}"),
            scripted::call("c3", "files__die", "{\"text\": \"now\"}"),
            scripted::answer("echoed, and the server died"),
        ],
    );
    let (config, log) = mcp_config(&d, &model.base_url());
    let config = config.display().to_string();
    let (code, out, err) = d.cli(&[
        "agent", "run", "--config", &config, "--model", "scripted", "--id", "mcp-1", "go",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("mcp-1 COMPLETED"), "{out}");
    let offered: Vec<String> = model.calls()[0]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        offered,
        ["files__echo", "files__write", "files__block", "files__die"]
    );
    assert_eq!(
        std::fs::read_to_string(&log).unwrap(),
        "call echo hi\ncall die now\n",
        "the refused write never reached the server"
    );
    let last = model.calls()[3]["messages"].as_array().unwrap().clone();
    let obs = |id: &str| {
        last.iter().find(|m| m["tool_call_id"] == id).unwrap()["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(obs("c1"), "echo: hi");
    assert!(obs("c2").contains("REFUSED"), "{}", obs("c2"));
    assert!(
        obs("c3").contains("may or may not have acted"),
        "{}",
        obs("c3")
    );
    assert_eq!(effect_status(&d, "mcp-1", "c1"), "completed");
    assert_eq!(effect_status(&d, "mcp-1", "c3"), "unknown");
}

/// The status of the effect `key` in `estop report RUN`.
/// Waits (at most 10 s) until effect `key` of `run` is `want` (an outcome the proxy sends
/// after the trajectory's end has its own way to the gate); returns what it last was.
fn effect_status_becomes(d: &Daemon, run: &str, key: &str, want: &str) -> String {
    common::poll(Duration::from_secs(10), Duration::from_millis(50), || {
        let now = effect_status(d, run, key);
        (now == want, now)
    })
}

fn effect_status(d: &Daemon, run: &str, key: &str) -> String {
    let (code, out, err) = d.cli(&["report", run, "--json"]);
    assert_eq!(code, 0, "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let effect = find_key(&report, key).unwrap_or_else(|| panic!("no {key}: {report:#}"));
    effect["status"].as_str().unwrap_or_default().to_string()
}

/// `estop agent run --config CONFIG --id ID go`, cancelled (`estop cancel ID`) once its tool
/// wrote `started` to the fifo `started`; returns the agent's (exit code, stdout, stderr).
fn cancel_once_started(
    d: &Daemon,
    config: &str,
    id: &str,
    started: &std::path::Path,
) -> (i32, String, String) {
    std::thread::scope(|s| {
        let agent = s.spawn(|| {
            d.cli(&[
                "agent", "run", "--config", config, "--model", "scripted", "--id", id, "go",
            ])
        });
        assert_eq!(std::fs::read_to_string(started).unwrap(), "started\n");
        let (code, _, err) = d.cli(&["cancel", id]);
        assert_eq!(code, 0, "{err}");
        agent.join().unwrap()
    })
}

/// `estop cancel` of the trajectory's run while an MCP call is in flight: the trajectory ends
/// CANCELED, the call is `unknown` at the gate, and the upstream hears
/// `notifications/cancelled` for it.
#[test]
fn a_cancel_cancels_the_mcp_call_in_flight_upstream() {
    let d = Daemon::start_with_policy(MCP_POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "files__block", "{\"text\": \"wait\"}"),
            scripted::answer("never asked"),
        ],
    );
    let (config, log) = mcp_config(&d, &model.base_url());
    let config = config.display().to_string();
    // Opening the fifo waits for the server to write it: the call is upstream now.
    let (code, out, err) = cancel_once_started(&d, &config, "mcp-2", &d.data().join("started"));
    assert_eq!(code, 3, "{out}{err}");
    assert!(out.starts_with("mcp-2 CANCELED"), "{out}");
    assert_eq!(model.calls().len(), 1, "no model call after the cancel");
    // The server logs the notice as it reads it; the runner awaited its write before exiting.
    let logged = common::poll(Duration::from_secs(10), Duration::from_millis(20), || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        (text.contains("cancelled"), text)
    });
    assert!(
        logged.starts_with("call block wait\ncancelled "),
        "{logged}"
    );
    assert_eq!(effect_status(&d, "mcp-2", "c1"), "unknown");
}

/// The agent config of the re-listing tests: the scripted model and `MCP_CHANGING_SERVER` as
/// `files`, with `extra` lines for its `[[server]]`; the config's path.
fn changing_server_config(d: &Daemon, model: &str, extra: &str) -> String {
    let server = d.data().join("changing.py");
    std::fs::write(&server, MCP_CHANGING_SERVER).unwrap();
    let config = d.data().join("agent.toml");
    let text = format!(
        "[[model]]\nname = \"scripted\"\nbase_url = \"{model}\"\nusd_per_mtok_input = 3.0\n\
         usd_per_mtok_output = 15.0\n\n[[server]]\nname = \"files\"\ncommand = \"python3\"\n\
         args = [\"-u\", {:?}]\n{extra}",
        server.display().to_string()
    );
    std::fs::write(&config, text).unwrap();
    config.display().to_string()
}

/// An MCP server that changes its tools: `flip` makes `echo`'s description `v2` and drops
/// `flip` (adding `fresh`) — with `$GROW` set, it lists 300 tools instead — then says
/// `notifications/tools/list_changed` before it answers.
const MCP_CHANGING_SERVER: &str = r#"
import json, os, sys
def send(msg):
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()
schema = {"type": "object", "properties": {"text": {"type": "string"}}}
def tool(n, desc):
    return {"name": n, "description": desc, "inputSchema": schema}
tools = [tool("echo", "the echo tool"), tool("flip", "changes the tools")]
for line in sys.stdin:
    msg = json.loads(line)
    method, mid = msg.get("method"), msg.get("id")
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": mid, "result": {
            "protocolVersion": msg["params"]["protocolVersion"],
            "capabilities": {"tools": {"listChanged": True}},
            "serverInfo": {"name": "py", "version": "1"}}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": mid, "result": {"tools": tools}})
    elif method == "tools/call":
        name = msg["params"]["name"]
        if name == "flip" and os.environ.get("GROW"):
            tools = [tool("t%d" % i, "one of many") for i in range(300)]
            send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        elif name == "flip":
            tools = [tool("echo", "the echo tool, v2"), tool("fresh", "new since the start")]
            send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        send({"jsonrpc": "2.0", "id": mid, "result": {
            "content": [{"type": "text", "text": "%s done" % name}]}})
    elif mid is not None:
        send({"jsonrpc": "2.0", "id": mid, "result": {}})
"#;

/// A server's `notifications/tools/list_changed`: the harness lists its tools again before
/// the next model call, so the model is offered the tools as they are now: `echo`'s new
/// description, `flip` gone. A tool the server adds after the start (`fresh`) is not offered:
/// the trajectory's grants are recorded at its start, and a server cannot widen them. The
/// tools' words are pinned as `estop mcp` pins them: the first call of `echo` after its
/// description changed is held for an operator whatever the policy says (allowed there),
/// approving it pins the new words, and the next call of it is not held. A call of the tool
/// that is gone is an error observation, and never reaches the server.
#[test]
fn a_servers_tools_list_changed_is_listed_again_before_the_next_turn() {
    let d = Daemon::start_with_policy(MCP_POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "files__flip", "{}"),
            scripted::call("c2", "files__echo", "{\"text\": \"a\"}"),
            scripted::call("c3", "files__echo", "{\"text\": \"b\"}"),
            scripted::call("c4", "files__flip", "{}"),
            scripted::answer("flipped"),
        ],
    );
    let config = changing_server_config(&d, &model.base_url(), "");
    // The operator approves every call held while the agent runs, noting which and why.
    let (held, (code, out, err)) = std::thread::scope(|s| {
        let agent = s.spawn(|| {
            d.cli(&[
                "agent", "run", "--config", &config, "--model", "scripted", "--id", "mcp-l", "go",
            ])
        });
        let mut held = Vec::new();
        while !agent.is_finished() {
            let (_, pending, _) = d.cli(&["pending", "--json"]);
            let pending: serde_json::Value = serde_json::from_str(&pending).unwrap();
            for p in pending["pending"].as_array().unwrap() {
                let key = p["key"].as_str().unwrap().to_string();
                let (code, _, err) = d.cli(&["approve", "mcp-l", &key]);
                assert_eq!(code, 0, "{err}");
                held.push(key);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        (held, agent.join().unwrap())
    });
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("mcp-l COMPLETED"), "{out}");
    assert_eq!(held, ["c2"], "only the first call after the change");
    let calls = model.calls();
    let offered = |n: usize| -> Vec<(String, String)> {
        calls[n]["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                let f = &t["function"];
                let name = f["name"].as_str().unwrap().to_string();
                (name, f["description"].as_str().unwrap().to_string())
            })
            .collect()
    };
    let pair = |n: &str, d: &str| (n.to_string(), d.to_string());
    assert_eq!(
        offered(0),
        [
            pair("files__echo", "the echo tool"),
            pair("files__flip", "changes the tools")
        ]
    );
    // The notice reached the harness before the call's answer; by the turn after the next,
    // at the latest, the listing has been taken again.
    for n in 2..=4 {
        assert_eq!(offered(n), [pair("files__echo", "the echo tool, v2")]);
    }
    let last = calls[4]["messages"].as_array().unwrap().clone();
    let obs = |id: &str| {
        last.iter().find(|m| m["tool_call_id"] == id).unwrap()["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(obs("c1"), "flip done");
    assert_eq!(obs("c2"), "echo done");
    assert_eq!(obs("c3"), "echo done");
    assert_ne!(obs("c4"), "flip done", "the tool that is gone was not sent");
    let pins = std::fs::read_to_string(d.data().join("harness/mcp-pins.json")).unwrap();
    assert!(pins.contains("files__echo"), "{pins}");
}

/// A re-listing is bounded: a server that says its tools changed and then lists 300 (over the
/// 256 the harness offers per server) keeps the list it had, said on stderr; the trajectory
/// goes on with it.
#[test]
fn a_relisting_over_the_bound_keeps_the_previous_list() {
    let d = Daemon::start_with_policy(MCP_POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "files__flip", "{}"),
            scripted::call("c2", "files__echo", "{\"text\": \"a\"}"),
            scripted::answer("kept"),
        ],
    );
    let config = changing_server_config(&d, &model.base_url(), "env = { GROW = \"1\" }\n");
    let (code, out, err) = d.cli(&[
        "agent", "run", "--config", &config, "--model", "scripted", "--id", "mcp-g", "go",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("mcp-g COMPLETED"), "{out}");
    assert!(
        err.contains("lists 300 tools, over the 256") && err.contains("the previous list stays"),
        "{err}"
    );
    assert_eq!(model.calls().len(), 3);
    for (n, call) in model.calls().iter().enumerate() {
        let names: Vec<&str> = call["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["function"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["files__echo", "files__flip"], "call {n}");
    }
}

/// A `sandbox = true` server in the harness runs as `estop mcp` runs one: `estop run … --
/// SERVER` on the trajectory's daemon, the sandbox the child run `TRAJECTORY/SERVER-STAMP` of
/// the trajectory's run; its tools are offered and called through the sandbox's stdio as an
/// unsandboxed server's are, each call admitted by the gate in the trajectory's run.
#[test]
fn mcp_tools_of_a_sandboxed_server_are_admitted_then_sent_into_the_sandbox() {
    let d = Daemon::start_with_policy(SANDBOX_POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "files__echo", "{\"text\": \"boxed\"}"),
            scripted::answer("echoed from the sandbox"),
        ],
    );
    // Outside the daemon's data directory, which the sandbox hides.
    let dir = tempfile::tempdir().unwrap();
    let (server, log) = (dir.path().join("mcp.py"), dir.path().join("mcp.log"));
    std::fs::write(&server, MCP_SERVER).unwrap();
    let config = dir.path().join("agent.toml");
    let text = format!(
        "[[model]]\nname = \"scripted\"\nbase_url = \"{}\"\nusd_per_mtok_input = 3.0\n\
         usd_per_mtok_output = 15.0\n\n[[server]]\nname = \"files\"\ncommand = \"python3\"\n\
         args = [\"-u\", {:?}]\nenv = {{ LOG = {:?}, STARTED = \"/nonexistent\" }}\n\
         sandbox = true\n",
        model.base_url(),
        server.display().to_string(),
        log.display().to_string(),
    );
    std::fs::write(&config, text).unwrap();
    let config = config.display().to_string();
    let (code, out, err) = d.cli(&[
        "agent", "run", "--config", &config, "--model", "scripted", "--id", "mcp-s", "go",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("mcp-s COMPLETED"), "{out}");
    let last = model.calls()[1]["messages"].as_array().unwrap().clone();
    let obs = last.iter().find(|m| m["tool_call_id"] == "c1").unwrap();
    assert_eq!(obs["content"], "echo: boxed", "{obs}");
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "call echo boxed\n");
    assert_eq!(effect_status(&d, "mcp-s", "c1"), "completed");
    // The server ran as a sandbox, a child run of the trajectory's, its launch an effect.
    let (code, runs, err) = d.cli(&["runs", "--json"]);
    assert_eq!(code, 0, "{err}");
    let runs: serde_json::Value = serde_json::from_str(&runs).unwrap();
    let text = runs.to_string();
    let sandbox = text
        .split('"')
        .find(|s| s.starts_with("mcp-s/files-"))
        .unwrap_or_else(|| panic!("no sandbox run under mcp-s: {runs:#}"))
        .to_string();
    let (code, report, err) = d.cli(&["report", &sandbox, "--json"]);
    assert_eq!(code, 0, "{err}");
    assert!(report.contains("sandbox.run"), "{report}");
    let (code, status, err) = d.cli(&["status", &sandbox, "--json"]);
    assert_eq!(code, 0, "{err}");
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(status["parent"], "mcp-s", "{status}");
}

const SANDBOX_POLICY: &str = r#"
[defaults]
unknown_tool = "allow"

[[rules]]
tool = "sandbox.run"
action = "allow"

[[rules]]
tool = "http.*"
action = "allow"
"#;

/// `estop agent run`'s config for the sandbox tests, written in `dir` (outside the daemon's
/// data directory, which the sandbox hides): one `sandbox = true` tool running `argv`, the
/// sandbox allowed to reach 127.0.0.2 (the host's loopback, not the sandbox's).
fn sandbox_config(dir: &std::path::Path, model: &str, argv: &[String]) -> String {
    let settings = dir.join("sandbox.toml");
    std::fs::write(
        &settings,
        "[egress]\nallow_destinations = [\"127.0.0.2/32\"]\nhold_ms = 20000\n",
    )
    .unwrap();
    let config = dir.join("agent.toml");
    let text = format!(
        r#"
[[model]]
name = "scripted"
base_url = "{model}"
usd_per_mtok_input = 3.0
usd_per_mtok_output = 15.0

[[tool]]
name = "net"
command = {argv:?}
sandbox = true
sandbox_policy = {settings:?}
"#,
        settings = settings.display().to_string(),
    );
    std::fs::write(&config, text).unwrap();
    config.display().to_string()
}

/// A `sandbox = true` command runs inside `estop run`'s sandbox as the child run
/// `TRAJECTORY/CALL`: its request goes through the sandbox's proxy, where the gate admits it
/// as an effect of that run, and its output is the observation.
#[test]
fn a_sandboxed_command_runs_as_a_child_run_through_the_proxy() {
    let d = Daemon::start_with_policy(SANDBOX_POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "net", "{\"order\": 7}"),
            scripted::answer("posted"),
        ],
    );
    let target = rt
        .block_on(Scripted::start(
            "127.0.0.2:0",
            Script {
                responses: vec![vec![Step::Status {
                    status: 200,
                    body: "stored".into(),
                }]],
            },
        ))
        .unwrap();
    let url = format!("http://{}/orders", target.addr);
    let argv: Vec<String> = [
        "curl",
        "-sS",
        "-m",
        "30",
        "-X",
        "POST",
        "--data-binary",
        "@-",
        &url,
    ]
    .map(String::from)
    .to_vec();
    let dir = tempfile::tempdir().unwrap();
    let config = sandbox_config(dir.path(), &model.base_url(), &argv);
    let (code, out, err) = d.cli(&[
        "agent", "run", "--config", &config, "--model", "scripted", "--id", "sb-1", "go",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("sb-1 COMPLETED"), "{out}");
    assert_eq!(target.calls(), [json!({"order": 7})]);
    let last = model.calls()[1]["messages"].as_array().unwrap().clone();
    let obs = last.iter().find(|m| m["tool_call_id"] == "c1").unwrap();
    assert_eq!(obs["content"], "stored", "{obs}");
    assert_eq!(effect_status(&d, "sb-1", "c1"), "completed");
    let (code, report, err) = d.cli(&["report", "sb-1/c1", "--json"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        report.contains("\"tool\":\"http.POST\"") && report.contains("sandbox.run"),
        "the launch and the request were effects of the child run: {report}"
    );
}

/// `estop cancel` of the trajectory's run while a sandboxed command runs: the trajectory ends
/// CANCELED, the command's sandbox is gone with it, and the child run is stopped at the gate.
#[test]
fn a_cancel_ends_the_sandboxed_command_with_its_sandbox() {
    let d = Daemon::start_with_policy(SANDBOX_POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "net", "{}"),
            scripted::answer("never asked"),
        ],
    );
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("sandbox-started");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let script = format!("echo started > {}; exec sleep 4243", fifo.display());
    let argv = ["sh".to_string(), "-c".into(), script];
    let config = sandbox_config(dir.path(), &model.base_url(), &argv);
    let (code, out, err) = cancel_once_started(&d, &config, "sb-2", &fifo);
    assert_eq!(code, 3, "{out}{err}{:?}", model.calls().get(1));
    assert!(out.starts_with("sb-2 CANCELED"), "{out}");
    assert_eq!(effect_status(&d, "sb-2", "c1"), "unknown");
    let sleeping = || {
        std::fs::read_dir("/proc").unwrap().flatten().any(|p| {
            std::fs::read(p.path().join("cmdline"))
                .is_ok_and(|c| c.windows(4).any(|w| w == b"4243"))
        })
    };
    common::poll(Duration::from_secs(10), Duration::from_millis(20), || {
        (!sleeping(), ())
    });
    assert!(!sleeping(), "the sandboxed command outlived the cancel");
    let (code, status, err) = d.cli(&["status", "sb-2/c1", "--json"]);
    assert_eq!(code, 0, "{err}");
    assert!(status.contains("cancelled"), "{status}");
}

/// A sandboxed command past the tool deadline: the model sees the TIMEOUT marker and goes on,
/// the call is `unknown` at the gate, the command is gone with its sandbox, and the child run
/// `TRAJECTORY/CALL` ends at the gate with its launch settled by `estop run` (asked to end, not
/// killed outright: a killed supervisor left its `sandbox.run` effect in flight, so the child
/// run stayed `finalizing` until an operator settled it).
#[test]
fn a_sandboxed_command_past_its_deadline_ends_and_its_child_run_is_closed() {
    let d = Daemon::start_with_policy(SANDBOX_POLICY, &[]);
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "net", "{}"),
            scripted::answer("gave up on it"),
        ],
    );
    let dir = tempfile::tempdir().unwrap();
    let argv = ["sh".to_string(), "-c".into(), "exec sleep 4244".into()];
    let config = sandbox_config(dir.path(), &model.base_url(), &argv);
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.insert_str(0, "[harness]\ntool_deadline_ms = 1500\n");
    std::fs::write(&config, text).unwrap();
    let (code, out, err) = d.cli(&[
        "agent", "run", "--config", &config, "--model", "scripted", "--id", "sb-3", "go",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("sb-3 COMPLETED"), "{out}");
    let last = model.calls()[1]["messages"].as_array().unwrap().clone();
    let obs = last.iter().find(|m| m["tool_call_id"] == "c1").unwrap();
    assert!(
        obs["content"].as_str().unwrap().contains("TIMEOUT"),
        "{obs}"
    );
    assert_eq!(effect_status(&d, "sb-3", "c1"), "unknown");
    let sleeping = || {
        std::fs::read_dir("/proc").unwrap().flatten().any(|p| {
            std::fs::read(p.path().join("cmdline"))
                .is_ok_and(|c| c.windows(4).any(|w| w == b"4244"))
        })
    };
    let child_open = || {
        let (code, status, err) = d.cli(&["status", "sb-3/c1", "--json"]);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&status).unwrap();
        v["state"] == "active" || v["state"] == "finalizing"
    };
    common::poll(Duration::from_secs(10), Duration::from_millis(50), || {
        (!sleeping() && !child_open(), ())
    });
    assert!(!sleeping(), "the sandboxed command outlived its deadline");
    assert!(
        !child_open(),
        "the child run of the cut command ended, its launch effect settled: {}",
        d.cli(&["report", "sb-3/c1", "--json"]).1
    );
}

/// `estop bench agents` at a small scale prints every figure it promises (docs/PERFORMANCE.md,
/// "The harness"), the disk's raw rate beside them: every trajectory reached its held call,
/// and each interrupt was stored before the trajectory's next model call went out.
#[test]
fn the_agents_benchmark_reports_every_figure() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(common::bin())
        .args(["bench", "agents", "--trajectories", "20", "--controls", "2"])
        .args(["--json", "--data"])
        .arg(dir.path().join("data"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let f: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
    let n = |k: &str| f[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {f}"));
    assert_eq!(n("trajectories"), 20.0);
    assert_eq!(n("controls"), 2.0);
    assert!(
        n("bytes_per_waiting_trajectory") >= 0.0 && n("threads") >= 1.0,
        "{f}"
    );
    assert!(n("scheduler_ns_per_decision") > 0.0, "{f}");
    assert!(n("disk_overwrite_fdatasync_p50_us") > 0.0, "{f}");
    assert!(
        0.0 < n("interrupt_stored_ms_p50")
            && n("interrupt_stored_ms_p50") <= n("interrupt_to_next_call_ms_p50"),
        "{f}"
    );
}

/// Seed 004's approval gate, the harness's half: the reply proposing `drop_table` took the
/// tokens to 90.5% (the restrict stage) and the gate held the call. While it waits, the held
/// call in the journal shows the gate's approval request (id, quorum 1, nobody yet). The
/// operator approves — the gate's own re-check passes — but the harness re-checks its grants
/// before dispatch: only read-only tools remain at 90%, so the call never runs and the model
/// reads `NOT_GRANTED`, naming the restrict stage, with the approval's id, quorum and
/// approvers.
#[test]
fn an_approval_after_the_restrict_stage_never_dispatches_the_write() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let effects = d.data().join("effects");
    let rt = runtime();
    let heavy = vec![
        scripted::tool_start(0, "c1", "drop_table", "{\"table\": \"orders\"}"),
        scripted::finish("tool_calls"),
        scripted::usage(900, 0, 5),
        Step::Done,
    ];
    let model = model_server(&rt, vec![heavy, scripted::answer("left it alone")]);
    let mut opts = options(&d, &model.base_url(), &effects);
    opts.limits.tokens_max = Some(1_000);
    let run = spawn_runner(&rt, opts, "esc-1");
    // Held at the gate, and the journal's record shows its approval request.
    let mut approval = String::new();
    for _ in 0..600 {
        let (_, out, _) = d.cli(&["agent", "list", "--json"]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
        let held = &v["trajectories"][0]["held"][0];
        if held["quorum"] == 1 {
            assert_eq!(held["approvers"], json!([]), "{held}");
            approval = held["approval"].as_str().unwrap().to_string();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        !approval.is_empty(),
        "the held call never showed its approval request"
    );
    let (code, _, err) = d.cli(&["approve", "esc-1", "c1"]);
    assert_eq!(code, 0, "{err}");
    let runner = rt.block_on(run).unwrap();
    let rec = runner.record("esc-1").unwrap();
    assert_eq!(rec.state, State::Completed, "{:?}", rec.exit);
    assert!(
        std::fs::read_to_string(&effects)
            .unwrap_or_default()
            .is_empty(),
        "drop_table never ran"
    );
    let calls = model.calls();
    assert_eq!(calls.len(), 2);
    let obs = calls[1]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["tool_call_id"] == "c1")
        .expect("an observation for c1");
    let body: serde_json::Value = serde_json::from_str(obs["content"].as_str().unwrap()).unwrap();
    assert_eq!(body["status"], "REFUSED", "{body}");
    assert_eq!(body["reason"], "NOT_GRANTED", "{body}");
    assert!(
        body["message"].as_str().unwrap().contains("restrict"),
        "{body}"
    );
    assert_eq!(body["approval"], approval.as_str(), "{body}");
    assert_eq!(body["quorum"], 1, "{body}");
}

/// Quorum shown to the model: `drop_table` needs two approvers. One operator approves (a vote
/// short of the quorum: the gate's `decided` event makes the harness read the request again,
/// and the record shows that approver), then rejects: the model reads `APPROVAL_DENIED` with
/// the approval's id, quorum 2 and the approver so far, and the call never ran.
#[test]
fn a_refused_call_shows_the_model_its_quorum_and_approvers_so_far() {
    let policy = POLICY.replace(
        "tool = \"drop_table\"\naction = \"approve\"",
        "tool = \"drop_table\"\naction = \"approve\"\nquorum = 2",
    );
    assert!(policy.contains("quorum = 2"));
    let d = Daemon::start_with_policy(&policy, &[]);
    let effects = d.data().join("effects");
    let rt = runtime();
    let model = model_server(
        &rt,
        vec![
            scripted::call("c1", "drop_table", "{\"table\": \"orders\"}"),
            scripted::answer("left it alone"),
        ],
    );
    let run = spawn_runner(&rt, options(&d, &model.base_url(), &effects), "esc-2");
    let held = |want: usize| {
        for _ in 0..600 {
            let (_, out, _) = d.cli(&["agent", "list", "--json"]);
            let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
            let h = &v["trajectories"][0]["held"][0];
            if h["quorum"] == 2 && h["approvers"].as_array().map(Vec::len) == Some(want) {
                return h.clone();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the held call never showed {want} approver(s)");
    };
    let first = held(0);
    let (code, _, err) = d.cli(&["approve", "esc-2", "c1"]);
    assert_eq!(code, 0, "{err}");
    let after = held(1);
    assert_eq!(after["approval"], first["approval"]);
    let approver = after["approvers"][0].clone();
    let (code, _, err) = d.cli(&["reject", "esc-2", "c1", "--reason", "not today"]);
    assert_eq!(code, 0, "{err}");
    let runner = rt.block_on(run).unwrap();
    assert_eq!(runner.record("esc-2").unwrap().state, State::Completed);
    assert!(
        std::fs::read_to_string(&effects)
            .unwrap_or_default()
            .is_empty()
    );
    let calls = model.calls();
    let obs = calls[1]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["tool_call_id"] == "c1")
        .expect("an observation for c1");
    let body: serde_json::Value = serde_json::from_str(obs["content"].as_str().unwrap()).unwrap();
    assert_eq!(body["reason"], "APPROVAL_DENIED", "{body}");
    assert_eq!(body["approval"], first["approval"], "{body}");
    assert_eq!(body["quorum"], 2, "{body}");
    assert_eq!(body["approvers"], json!([approver]), "{body}");
}

/// The gate is killed (-9) and restarted while the model streams; `estop cancel` after the
/// restart is heard: the harness's connection comes back, subscribes again, and the stream is
/// cut; no model call follows. (Before the one client, the harness reconnected on its next
/// request but never subscribed again: the trajectory ran on and completed.)
#[test]
fn a_cancel_after_a_gate_restart_is_heard_and_cuts_the_stream() {
    let mut d = Daemon::start_with_policy(POLICY, &[]);
    let effects = d.data().join("effects");
    let rt = runtime();
    let server = model_server(
        &rt,
        vec![
            scripted::call("c1", "lookup", "{}"),
            vec![
                scripted::text("I will now drop"),
                Step::Gate,
                scripted::finish("stop"),
                Step::Done,
            ],
            scripted::answer("done"),
        ],
    );
    let mut opts = options(&d, &server.base_url(), &effects);
    // Unheard, the cancel would end the stream only at this deadline (the fence read before
    // the next model call would still end the trajectory, a minute late).
    opts.call_limits.call_deadline_ms = 60_000;
    let mut runner = rt.block_on(async { Runner::open(opts) }).unwrap();
    rt.block_on(async { runner.start("traj-r1", None, "work") })
        .unwrap();
    let run = rt.spawn(async move {
        runner.run().await.unwrap();
        runner
    });
    rt.block_on(server.wait_for(&Seen::Call { n: 1 }));
    d.restart();
    let (code, _, err) = d.cli(&["cancel", "traj-r1", "--reason", "after the restart"]);
    assert_eq!(code, 0, "{err}");
    let runner = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(30), run).await })
        .expect("the cancel was heard: the stream was cut long before its deadline")
        .unwrap();
    let rec = runner.record("traj-r1").unwrap();
    assert_eq!(rec.state, State::Canceled, "{:?}", rec.exit);
    rt.block_on(server.wait_for(&Seen::Gone { n: 1, step: 1 }));
    assert_eq!(server.calls().len(), 2, "no model call after the cancel");
}

/// A call held for approval; the gate is killed (-9) and restarted; `estop approve` after the
/// restart is heard (the held call is asked about again on the new connection) and the call
/// runs once.
#[test]
fn an_approval_after_a_gate_restart_is_heard_and_the_call_runs_once() {
    let mut d = Daemon::start_with_policy(POLICY, &[]);
    let effects = d.data().join("effects");
    let rt = runtime();
    let server = model_server(
        &rt,
        vec![
            scripted::call("c1", "drop_table", "{\"table\": \"t\"}"),
            scripted::answer("dropped"),
        ],
    );
    let mut runner = rt
        .block_on(async { Runner::open(options(&d, &server.base_url(), &effects)) })
        .unwrap();
    rt.block_on(async { runner.start("traj-r2", None, "drop t") })
        .unwrap();
    let run = rt.spawn(async move {
        runner.run().await.unwrap();
        runner
    });
    let listed = common::poll(Duration::from_secs(20), Duration::from_millis(50), || {
        let (_, out, _) = d.cli(&["pending"]);
        (out.contains("traj-r2"), out)
    });
    assert!(listed.contains("traj-r2"), "{listed}");
    d.restart();
    let (code, _, err) = d.cli(&["approve", "traj-r2", "c1"]);
    assert_eq!(code, 0, "{err}");
    let runner = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(60), run).await })
        .expect("the approval made after the restart was heard")
        .unwrap();
    let rec = runner.record("traj-r2").unwrap();
    assert_eq!(rec.state, State::Completed, "{:?}", rec.exit);
    assert_eq!(std::fs::read_to_string(&effects).unwrap(), "drop_table\n");
}

/// A partition between the harness and the gate while the model streams: the operator's
/// cancel lands while the harness cannot hear; once the partition heals, the harness's
/// connection comes back, the subscription's replay says the run was cancelled, and the
/// stream is cut at once (not at its deadline). With no look at the run after a reconnect,
/// the cancel would be heard only by the fence read before the next model call, a minute on.
#[test]
fn a_cancel_made_during_a_partition_is_heard_when_it_heals() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let effects = d.data().join("effects");
    let wall = common::partition::Partition::start(&d.socket(), &d.data().join("relay.sock"));
    let rt = runtime();
    let server = model_server(
        &rt,
        vec![
            scripted::call("c1", "lookup", "{}"),
            vec![
                scripted::text("I will now drop"),
                Step::Gate,
                scripted::finish("stop"),
                Step::Done,
            ],
            scripted::answer("done"),
        ],
    );
    let mut opts = options(&d, &server.base_url(), &effects);
    opts.gate.target = wall.path();
    opts.call_limits.call_deadline_ms = 60_000;
    let mut runner = rt.block_on(async { Runner::open(opts) }).unwrap();
    rt.block_on(async { runner.start("traj-p1", None, "work") })
        .unwrap();
    let run = rt.spawn(async move {
        runner.run().await.unwrap();
        runner
    });
    rt.block_on(server.wait_for(&Seen::Call { n: 1 }));
    wall.cut();
    let (code, _, err) = d.cli(&["cancel", "traj-p1", "--reason", "during the partition"]);
    assert_eq!(code, 0, "{err}");
    std::thread::sleep(Duration::from_millis(300));
    wall.heal();
    let runner = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(30), run).await })
        .expect("the cancel made while away was heard once the partition healed")
        .unwrap();
    let rec = runner.record("traj-p1").unwrap();
    assert_eq!(rec.state, State::Canceled, "{:?}", rec.exit);
    assert_eq!(server.calls().len(), 2, "no model call after the cancel");
}

/// A call held for approval; a partition between the harness and the gate; the operator
/// approves while the harness cannot hear. Once it heals, the held call is asked about again
/// on the new connection and runs once. (The decision's event went to a connection that was
/// gone: only the look after the reconnect hears it.)
#[test]
fn an_approval_made_during_a_partition_is_heard_when_it_heals() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let effects = d.data().join("effects");
    let wall = common::partition::Partition::start(&d.socket(), &d.data().join("relay.sock"));
    let rt = runtime();
    let server = model_server(
        &rt,
        vec![
            scripted::call("c1", "drop_table", "{\"table\": \"t\"}"),
            scripted::answer("dropped"),
        ],
    );
    let mut opts = options(&d, &server.base_url(), &effects);
    opts.gate.target = wall.path();
    let mut runner = rt.block_on(async { Runner::open(opts) }).unwrap();
    rt.block_on(async { runner.start("traj-p2", None, "drop t") })
        .unwrap();
    let run = rt.spawn(async move {
        runner.run().await.unwrap();
        runner
    });
    let listed = common::poll(Duration::from_secs(20), Duration::from_millis(50), || {
        let (_, out, _) = d.cli(&["pending"]);
        (out.contains("traj-p2"), out)
    });
    assert!(listed.contains("traj-p2"), "{listed}");
    wall.cut();
    let (code, _, err) = d.cli(&["approve", "traj-p2", "c1"]);
    assert_eq!(code, 0, "{err}");
    std::thread::sleep(Duration::from_millis(300));
    wall.heal();
    let runner = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(60), run).await })
        .expect("the approval made while away was heard once the partition healed")
        .unwrap();
    let rec = runner.record("traj-p2").unwrap();
    assert_eq!(rec.state, State::Completed, "{:?}", rec.exit);
    assert_eq!(std::fs::read_to_string(&effects).unwrap(), "drop_table\n");
}
