//! The harness against a hostile model and a curious tool (issue 27), with a real daemon: a
//! model reply that would have taken the runner down (a tool call at index 10^12) is cut with
//! a typed overflow the model is told of, before and after a resume; and a command tool,
//! sandboxed or not, sees none of the runner's secrets (the provider key, a credential store's
//! source variables, any variable its config did not pass), nor does the model.

mod common;

use common::{Daemon, bin};
use estop_harness::budget::{Limits, Prices};
use estop_harness::gate::GateConfig;
use estop_harness::machine::State;
use estop_harness::model::ModelClient;
use estop_harness::record::CallLimits;
use estop_harness::runner::{Runner, RunnerOptions, Tool};
use estop_harness::scripted::{self, Script, Scripted, Seen, Step};
use serde_json::json;
use std::time::Duration;

const POLICY: &str = r#"
[defaults]
unknown_tool = "allow"

[[rules]]
tool = "sandbox.run"
action = "allow"

[[rules]]
tool = "http.*"
action = "allow"
"#;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn options(d: &Daemon, model: &str, effects: &std::path::Path) -> RunnerOptions {
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
        tools: vec![Tool {
            name: "drop_table".into(),
            description: "drop".into(),
            parameters: json!({"type": "object"}),
            command: vec![
                "sh".into(),
                "-c".into(),
                format!("echo dropped >> {}; cat", effects.display()),
            ],
            ..Tool::default()
        }],
        system: "You are a careful agent.".into(),
        grace: Duration::from_millis(100),
        workers: 2,
        tpm: 1_000_000,
        rpm: 1_000,
        journal: Default::default(),
    }
}

/// The reply of issue 27: one delta proposing a call at index 10^12, then a proper finish.
fn trillion() -> Vec<Step> {
    vec![
        scripted::tool_start(1_000_000_000_000, "c1", "drop_table", "{}"),
        scripted::finish("tool_calls"),
        Step::Done,
    ]
}

/// The messages the model was sent in call `n`, as one string.
fn sent(model: &Scripted, n: usize) -> String {
    model.calls()[n]["messages"].to_string()
}

/// A model reply with a tool call at index 10^12 once made the runner push empty calls until
/// the allocator aborted the process, again on every resume. Now the runner (this test's own
/// process) lives on: the reply is cut with the typed overflow, the model's next call carries
/// the notice (`REPLY_OVERFLOW`, the index and the bound), nothing is dispatched or admitted.
/// The runner then crashes during the next model call; a new runner resumes the trajectory,
/// the retried call gets the same hostile reply, cut again and told again, and the trajectory
/// completes with the model's answer.
#[test]
fn a_tool_call_at_index_a_trillion_is_cut_told_and_survives_a_resume() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let effects = d.data().join("effects");
    let mut gated = vec![Step::Gate];
    gated.extend(trillion());
    let server_rt = runtime();
    let model = server_rt
        .block_on(Scripted::start(
            "127.0.0.1:0",
            Script {
                responses: vec![trillion(), gated, trillion(), scripted::answer("done")],
            },
        ))
        .unwrap();
    let opts = options(&d, &model.base_url(), &effects);
    let rt = runtime();
    let mut runner = rt.block_on(async { Runner::open(opts.clone()) }).unwrap();
    rt.block_on(async { runner.start("hx-1", None, "drop nothing") })
        .unwrap();
    let task = rt.spawn(async move { runner.run().await });
    // The second call is open (gated): the first reply was cut and the runner went on.
    rt.block_on(model.wait_for(&Seen::Call { n: 1 }));
    let told = sent(&model, 1);
    assert!(
        told.contains("REPLY_OVERFLOW") && told.contains("1000000000000"),
        "{told}"
    );
    task.abort();
    rt.shutdown_timeout(Duration::from_secs(10));

    let rt = runtime();
    let mut runner = rt.block_on(async { Runner::open(opts) }).unwrap();
    assert_eq!(runner.record("hx-1").unwrap().state, State::CallingModel);
    let runner = rt.block_on(async move {
        runner.run().await.unwrap();
        runner
    });
    let rec = runner.record("hx-1").unwrap();
    assert_eq!(rec.state, State::Completed, "{rec:?}");
    assert_eq!(model.calls().len(), 4);
    let last = sent(&model, 3);
    assert_eq!(last.matches("REPLY_OVERFLOW").count(), 2, "{last}");
    assert!(!effects.exists(), "nothing was dispatched");
    // Nothing was admitted either: the gate never heard of the run (it is made with the
    // first effect).
    let (code, report, err) = d.cli(&["report", "hx-1", "--json"]);
    assert!(
        (code != 0 && err.contains("not found")) || (code == 0 && !report.contains("drop_table")),
        "{code} {report} {err}"
    );
}

/// Writes a 0600 credential store with one bearer credential read from `var`.
fn store(dir: &std::path::Path, name: &str, host: &str, var: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    std::fs::write(
        &p,
        format!("[[credential]]\nhost = \"{host}\"\nbearer_env = \"{var}\"\n"),
    )
    .unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p.display().to_string()
}

/// `estop agent run`'s config for the environment test, in `dir`: the provider key in
/// `SECRET_PROVIDER_KEY`; `show_env` (`env`, unsandboxed) and `show_env_sb` (`env` inside the
/// sandbox, whose own store reads `SANDBOX_STORE_TOKEN`), each passed `PASSED_VAR` and set
/// `TOOL_SET`; and an HTTP tool whose store reads `ORDERS_TOKEN`.
fn env_config(dir: &std::path::Path, model: &str, extra: &str) -> String {
    let orders = store(dir, "orders.toml", "orders.example", "ORDERS_TOKEN");
    let sb = store(dir, "sb-store.toml", "sb.example", "SANDBOX_STORE_TOKEN");
    let egress = dir.join("egress.toml");
    std::fs::write(&egress, format!("[egress]\ncredentials = {orders:?}\n")).unwrap();
    let sandbox = dir.join("sandbox.toml");
    std::fs::write(&sandbox, format!("[egress]\ncredentials = {sb:?}\n")).unwrap();
    let config = dir.join("agent.toml");
    let text = format!(
        r#"
[[model]]
name = "scripted"
base_url = "{model}"
api_key_env = "SECRET_PROVIDER_KEY"
usd_per_mtok_input = 3.0
usd_per_mtok_output = 15.0

[[tool]]
name = "show_env"
command = ["env"]
env = {{ TOOL_SET = "set-by-config" }}
env_pass = ["PASSED_VAR"{extra}]

[[tool]]
name = "show_env_sb"
command = ["env"]
sandbox = true
sandbox_policy = {sandbox:?}
env = {{ TOOL_SET = "set-by-config" }}
env_pass = ["PASSED_VAR"]

[[tool]]
name = "fetch_order"
url = "http://orders.example/api"
egress_policy = {egress:?}
"#,
        sandbox = sandbox.display().to_string(),
        egress = egress.display().to_string(),
    );
    std::fs::write(&config, text).unwrap();
    config.display().to_string()
}

/// Runs `estop agent run` on `d` with `vars` in its environment.
fn agent_run(d: &Daemon, config: &str, id: &str, vars: &[(&str, &str)]) -> (i32, String, String) {
    let out = std::process::Command::new(bin())
        .args(["agent", "run", "--config", config, "--model", "scripted"])
        .args(["--id", id, "show me your environment", "--data"])
        .arg(d.data())
        .envs(vars.iter().copied())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// Issue 27: a command tool printing its environment saw the provider key and an HTTP tool's
/// credential, and the next model request carried both. Now `show_env` (unsandboxed) and
/// `show_env_sb` (inside `estop run`, whose own store's variable it must not see either) print
/// only the allow-list, the variable passed and the one set: none of the runner's secrets, nor
/// an unrelated `FOO_SECRET`, reaches either tool or any request the model receives (the key
/// is in the requests' `Authorization` header, where it belongs). A config passing the
/// provider key or a credential's variable to a tool is refused, naming the tool, before any
/// model call.
#[test]
fn no_variable_of_the_runners_environment_reaches_a_tool_or_the_model_unless_passed() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let rt = runtime();
    let model = rt
        .block_on(Scripted::start(
            "127.0.0.1:0",
            Script {
                responses: vec![
                    scripted::call("c1", "show_env", "{}"),
                    scripted::call("c2", "show_env_sb", "{}"),
                    scripted::answer("seen"),
                ],
            },
        ))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = env_config(dir.path(), &model.base_url(), "");
    let nonce = format!("{:x}", std::process::id() as u64 * 7919 + 17);
    let secrets = [
        ("SECRET_PROVIDER_KEY", format!("sk-provider-{nonce}")),
        ("ORDERS_TOKEN", format!("orders-bearer-{nonce}")),
        ("SANDBOX_STORE_TOKEN", format!("sandbox-bearer-{nonce}")),
        ("FOO_SECRET", format!("foo-secret-{nonce}")),
    ];
    let mut vars: Vec<(&str, &str)> = secrets.iter().map(|(k, v)| (*k, v.as_str())).collect();
    vars.push(("PASSED_VAR", "passed-value"));
    let (code, out, err) = agent_run(&d, &config, "env-1", &vars);
    assert_eq!(code, 0, "{out}{err}");
    let calls = model.calls();
    assert_eq!(calls.len(), 3, "{out}{err}");
    let all = serde_json::to_string(&calls).unwrap();
    for call in ["c1", "c2"] {
        let obs = calls[2]["messages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["tool_call_id"] == call)
            .unwrap()["content"]
            .as_str()
            .unwrap()
            .to_string();
        for want in ["PATH=", "TOOL_SET=set-by-config", "PASSED_VAR=passed-value"] {
            assert!(obs.contains(want), "{call} lacks {want}: {obs}");
        }
        // c2 ran inside the sandbox (its proxy's variables are estop run's), c1 did not.
        assert_eq!(obs.contains("HTTPS_PROXY="), call == "c2", "{call}: {obs}");
        for (name, value) in &secrets {
            assert!(
                !obs.contains(name) && !obs.contains(value.as_str()),
                "{call} saw {name}: {obs}"
            );
        }
    }
    for (name, value) in &secrets {
        assert!(
            !all.contains(value.as_str()),
            "the model was sent {name}: {all}"
        );
    }
    let auth = format!("Bearer sk-provider-{nonce}");
    assert!(
        model
            .headers()
            .iter()
            .all(|h| h.contains(&("authorization".to_string(), auth.clone()))),
        "the key goes to the provider as the key"
    );
    for (extra, var) in [
        (", \"SECRET_PROVIDER_KEY\"", "SECRET_PROVIDER_KEY"),
        (", \"ORDERS_TOKEN\"", "ORDERS_TOKEN"),
        (", \"SANDBOX_STORE_TOKEN\"", "SANDBOX_STORE_TOKEN"),
    ] {
        let config = env_config(dir.path(), &model.base_url(), extra);
        let (code, _, err) = agent_run(&d, &config, "env-2", &vars);
        assert_eq!(code, 1, "{err}");
        assert!(
            err.contains("tool \"show_env\"") && err.contains(var) && err.contains("injection"),
            "{err}"
        );
    }
    assert_eq!(model.calls().len(), 3, "no model call for a refused config");
}
