//! `estop bench agents`: the harness at scale (docs/PERFORMANCE.md, "The harness"). N trajectories
//! each propose a call the gate holds for approval and wait — the common state of a fleet of
//! agents — in one runner against a daemon the bench starts and the scripted model server:
//! memory per waiting trajectory, the scheduler's cost per decision with N queued, and the
//! time from an `estop agent interrupt` (control socket) to the trajectory's next model call
//! while its stream is open.

use anyhow::{Context, Result, anyhow};
use estop_harness::budget::{Limits, Prices};
use estop_harness::control::{self, Ask, Request};
use estop_harness::gate::GateConfig;
use estop_harness::model::ModelClient;
use estop_harness::record::CallLimits;
use estop_harness::runner::{Runner, RunnerOptions, Tool};
use estop_harness::scheduler::{Class, Next, Scheduler, TokenBucket, Weights};
use estop_harness::scripted::{self, Script, Scripted, Seen, Step};
use serde_json::json;
use std::path::Path;
use std::time::{Duration, Instant};

const POLICY: &str = "[[rules]]\ntool = \"hold\"\naction = \"approve\"\n";

pub fn run(trajectories: usize, controls: usize, data: &Path, json_out: bool) -> Result<u8> {
    let (n, k) = (trajectories.max(1), controls.max(1));
    let _ = std::fs::remove_dir_all(data);
    std::fs::create_dir_all(data)?;
    // The disk's raw rate, beside the figures: an interrupt is answered once it is durable.
    let disk = estop_bench::probe_disk(data).context("probing the disk")?;
    let policy = data.with_extension("policy.toml");
    std::fs::write(&policy, POLICY)?;
    let spawned = crate::bench::spawn_daemon_with(
        &data.join("gate"),
        &["--policy", &policy.display().to_string()],
    )?;
    let token = std::fs::read_to_string(data.join("gate/agent.token"))?
        .trim()
        .to_string();
    let operator = std::fs::read_to_string(data.join("gate/operator.token"))?
        .trim()
        .to_string();
    let gate = GateConfig {
        target: spawned.socket.clone(),
        token,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    // The n waiting trajectories' calls, then k streams left open, then k answers.
    let mut responses = vec![scripted::call("c1", "hold", "{}"); n];
    responses.extend(vec![vec![scripted::text("working"), Step::Gate]; k]);
    responses.extend(vec![scripted::answer("done"); k]);
    let server = rt.block_on(Scripted::start("127.0.0.1:0", Script { responses }))?;
    let opts = |dir: &str, workers| -> Result<RunnerOptions> {
        Ok(RunnerOptions {
            data: data.join(dir),
            gate: gate.clone(),
            model: ModelClient::new(&server.base_url(), None)?,
            call_limits: CallLimits {
                model: "scripted".into(),
                max_output_tokens: 256,
                call_deadline_ms: 600_000,
                tool_deadline_ms: 600_000,
                retry: Default::default(),
            },
            limits: Limits::default(),
            prices: Prices::default(),
            upstreams: Default::default(),
            subagents: None,
            workspaces: None,
            contract: None,
            sandbox: None,
            tools: vec![Tool {
                name: "hold".into(),
                description: "held for approval".into(),
                parameters: json!({"type": "object"}),
                command: vec!["true".into()],
                ..Tool::default()
            }],
            system: "bench".into(),
            grace: Duration::from_millis(100),
            workers,
            tpm: u64::MAX / 4,
            rpm: u64::MAX / 4,
            journal: Default::default(),
        })
    };
    let rss0 = rss_bytes();
    let started = Instant::now();
    let mut fleet =
        rt.block_on(async { Runner::open(opts("fleet", 64)?).map_err(anyhow::Error::from) })?;
    for i in 0..n {
        rt.block_on(async { fleet.start(&format!("t-{i}"), None, "wait for a human") })?;
    }
    // Subscribed before the fleet runs, so no `held` event is missed.
    let watcher = subscribe_all(&spawned.socket, &operator, n)?;
    let fleet = rt.spawn(async move {
        let _ = fleet.run().await;
    });
    wait_held(watcher, n)?;
    let settle = started.elapsed();
    let rss = rss_bytes().saturating_sub(rss0);
    let bodies: usize = server.calls().iter().map(|c| c.to_string().len()).sum();

    // Control latency: k more trajectories on a runner of their own, each with a stream open.
    let mut ctl =
        rt.block_on(async { Runner::open(opts("ctl", k)?).map_err(anyhow::Error::from) })?;
    for i in 0..k {
        rt.block_on(async { ctl.start(&format!("ctl-{i}"), None, "be interrupted") })?;
    }
    let ctl = rt.spawn(async move {
        let _ = ctl.run().await;
    });
    rt.block_on(server.wait_for(&Seen::Call { n: n + k - 1 }));
    let (mut stored, mut boundary) = (Vec::new(), Vec::new());
    for i in 0..k {
        let req = Request {
            token: operator.clone(),
            trajectory: format!("ctl-{i}"),
            ask: Ask::Interrupt {
                message: "change of plan".into(),
            },
        };
        let t0 = Instant::now();
        control::ask(&data.join("ctl"), &req).map_err(|e| anyhow!("interrupt: {e}"))?;
        stored.push(t0.elapsed());
        rt.block_on(server.wait_for(&Seen::Call { n: n + k + i }));
        boundary.push(t0.elapsed());
    }
    rt.block_on(ctl).context("the control runner")?;
    let sched_ns = scheduler_ns_per_decision(n);
    fleet.abort();
    let pct = |v: &mut Vec<Duration>, p: usize| {
        v.sort();
        v[(v.len() * p / 100).min(v.len() - 1)].as_secs_f64() * 1e3
    };
    let figures = json!({
        "trajectories": n,
        "settle_s": settle.as_secs_f64(),
        "bytes_per_waiting_trajectory": rss as f64 / n as f64,
        "model_request_bytes_kept_by_the_scripted_server_per_trajectory": bodies as f64 / n as f64,
        "threads": threads(),
        "scheduler_ns_per_decision": sched_ns,
        "controls": k,
        "interrupt_stored_ms_p50": pct(&mut stored, 50),
        "interrupt_stored_ms_max": pct(&mut stored, 100),
        "interrupt_to_next_call_ms_p50": pct(&mut boundary, 50),
        "interrupt_to_next_call_ms_max": pct(&mut boundary, 100),
        "disk_overwrite_fdatasync_p50_us": disk.overwrite.p50_us,
        "disk_overwrite_fdatasyncs_per_s": disk.overwrite.syncs_per_s,
    });
    if json_out {
        println!("{figures}");
    } else {
        print(&figures);
    }
    Ok(0)
}

fn print(f: &serde_json::Value) {
    println!(
        "disk: raw overwrite+fdatasync p50 {:.0} us ({:.0}/s)",
        f["disk_overwrite_fdatasync_p50_us"].as_f64().unwrap_or(0.0),
        f["disk_overwrite_fdatasyncs_per_s"].as_f64().unwrap_or(0.0)
    );
    println!(
        "{} trajectories waiting for approval after {:.1} s: {:.0} bytes each (RSS delta; includes {:.0} bytes of request body the scripted server keeps per trajectory), {} threads",
        f["trajectories"],
        f["settle_s"].as_f64().unwrap_or(0.0),
        f["bytes_per_waiting_trajectory"].as_f64().unwrap_or(0.0),
        f["model_request_bytes_kept_by_the_scripted_server_per_trajectory"]
            .as_f64()
            .unwrap_or(0.0),
        f["threads"]
    );
    println!(
        "scheduler: {:.0} ns per decision with {} trajectories queued",
        f["scheduler_ns_per_decision"].as_f64().unwrap_or(0.0),
        f["trajectories"]
    );
    println!(
        "interrupt with the stream open ({} samples): stored (durable) p50 {:.2} ms, max {:.2} ms; to the next model call p50 {:.2} ms, max {:.2} ms",
        f["controls"],
        f["interrupt_stored_ms_p50"].as_f64().unwrap_or(0.0),
        f["interrupt_stored_ms_max"].as_f64().unwrap_or(0.0),
        f["interrupt_to_next_call_ms_p50"].as_f64().unwrap_or(0.0),
        f["interrupt_to_next_call_ms_max"].as_f64().unwrap_or(0.0),
    );
}

/// One operator connection subscribed to the `n` runs (a subscription may name a run not
/// created yet).
fn subscribe_all(socket: &str, operator: &str, n: usize) -> Result<estop_server::client::Client> {
    use estop_protocol::{Fields, Verb};
    let mut c = estop_server::client::Client::connect_as(socket, operator)?;
    for i in 0..n {
        let (mut f, run) = (Fields::new(), format!("t-{i}"));
        f.text("run", &run);
        c.request(&f.build(Verb::Subscribe).map_err(|e| anyhow!("{e}"))?.op)?;
    }
    Ok(c)
}

/// Blocks until the gate has held `n` calls (their `held` events).
fn wait_held(mut c: estop_server::client::Client, n: usize) -> Result<()> {
    let mut held = 0;
    while held < n {
        if let Some(e) = c.next_event()? {
            held += usize::from(e.event == estop_protocol::EventKind::Held);
        }
    }
    Ok(())
}

/// The scheduler alone: `n` trajectories queued across the classes; each decision picks one
/// and queues it again (its next turn), so the queue stays at `n`.
fn scheduler_ns_per_decision(n: usize) -> f64 {
    let bucket = TokenBucket::new(u64::MAX / 4, u64::MAX / 4, 0);
    let mut s = Scheduler::new(Weights::default(), 4_096, bucket);
    let classes = [Class::Interactive, Class::Standard, Class::Batch];
    for i in 0..n {
        s.push(i, classes[i % 3], 1_000 + (i as u64 % 7) * 100);
    }
    let decisions = 1_000_000;
    let t0 = Instant::now();
    for d in 0..decisions {
        if let Next::Run(i) = s.next(d as u64) {
            s.push(i, classes[i % 3], 1_000 + (i as u64 % 7) * 100);
        }
    }
    t0.elapsed().as_nanos() as f64 / decisions as f64
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn threads() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0)
}
