//! kill -9 soak: the real daemon under concurrent load (agents admitting, approvals pending),
//! SIGKILLed at a random moment of progress and restarted, checked from the clients'
//! acknowledgements after every restart: nothing acknowledged is lost, nothing is admitted twice,
//! pending approvals survive. 50 cycles in CI; `ESTOP_SOAK_CYCLES=1000` for the long mode;
//! `ESTOP_SOAK_SEED` replays the kill points (docs/TESTING.md).

mod common;

use common::{Daemon, Wire, ok, verdict};
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.parse().ok()
}

/// What one agent thread was told in one cycle.
#[derive(Default)]
struct Acked {
    admitted: Vec<(String, String, String)>,
    held: Vec<(String, String)>,
}

#[test]
fn kill9_soak_loses_nothing_acknowledged_and_admits_nothing_twice() {
    let cycles = env_u64("ESTOP_SOAK_CYCLES").unwrap_or(50);
    let seed = env_u64("ESTOP_SOAK_SEED").unwrap_or(0x50A1);
    println!("kill -9 soak: {cycles} cycles, seed {seed} (replay: ESTOP_SOAK_SEED={seed})");
    let mut rng = seed;
    let mut next = move || {
        rng = rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut d = Daemon::start();
    let threads = 4;
    let mut all_admitted: Vec<(String, String, String)> = Vec::new();
    let mut all_held: Vec<(String, String)> = Vec::new();
    let (mut total_acked, mut total_checked) = (0usize, 0usize);
    for cycle in 0..cycles {
        let progress = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let mut handles = Vec::new();
        for t in 0..threads {
            let (socket, token) = (d.socket(), d.token("agent.token"));
            let (progress, stop) = (Arc::clone(&progress), Arc::clone(&stop));
            handles.push(std::thread::spawn(move || {
                let mut acked = Acked::default();
                let Ok(mut c) = estop_server::client::Client::connect_as(&socket, &token) else { return acked };
                for i in 0.. {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    // Every 7th call needs approval (kept in its own run so it does not hold the
                    // others as siblings); the rest are allowed writes.
                    let (run, tool) = if i % 7 == 3 { (format!("h{cycle}-{t}"), "refund") } else { (format!("s{cycle}-{t}"), "pay") };
                    let key = format!("k{i}");
                    match c.call(json!({"op": "admit", "run": run, "key": key, "tool": tool, "args": {"i": i}})) {
                        Ok(r) if r.raw["verdict"] == "admitted" => {
                            acked.admitted.push((run, key, r.raw["token"].as_str().unwrap_or_default().to_string()));
                        }
                        Ok(r) if r.raw["verdict"] == "held" => acked.held.push((run, key)),
                        Ok(r) => panic!("unexpected reply under load: {}", r.raw),
                        Err(_) => break,
                    }
                    progress.fetch_add(1, Ordering::Relaxed);
                }
                acked
            }));
        }
        // Kill at a random point of progress (observed, not slept for).
        let target = 1 + next() % 200;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while progress.load(Ordering::Relaxed) < target && std::time::Instant::now() < deadline {
            std::thread::yield_now();
        }
        d.kill9();
        stop.store(true, Ordering::Relaxed);
        let mut admitted = Vec::new();
        let mut held = Vec::new();
        for h in handles {
            let a = h.join().expect("agent thread");
            admitted.extend(a.admitted);
            held.extend(a.held);
        }
        total_acked += admitted.len() + held.len();
        d.spawn();
        // Check this cycle's acknowledgements, and a sample of every earlier one.
        let mut a = d.agent();
        let sample: Vec<_> = all_admitted
            .iter()
            .filter(|_| next() % 20 == 0)
            .cloned()
            .collect();
        for (run, key, token) in admitted.iter().chain(sample.iter()) {
            let i: u64 = key[1..].parse().unwrap();
            let v = ok(
                &mut a,
                json!({"op": "admit", "run": run, "key": key, "tool": "pay", "args": {"i": i}}),
            );
            assert_eq!(
                (verdict(&v), v["status"].as_str()),
                ("duplicate", Some("in_progress")),
                "cycle {cycle}: acknowledged admission {run}/{key} ({token}) lost or admitted twice"
            );
            total_checked += 1;
        }
        let mut op = d.operator();
        let pending = ok(&mut op, json!({"op": "pending"}));
        let pending: std::collections::BTreeSet<(String, String)> = pending["pending"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                (
                    p["run"].as_str().unwrap().to_string(),
                    p["key"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        for h in held.iter().chain(all_held.iter()) {
            assert!(
                pending.contains(h),
                "cycle {cycle}: acknowledged pending approval {h:?} lost"
            );
            total_checked += 1;
        }
        all_admitted.extend(admitted);
        all_held.extend(held);
    }
    let verify = std::process::Command::new(common::bin())
        .args(["ledger", "verify", "--data"])
        .arg(d.data())
        .output()
        .unwrap();
    assert!(
        verify.status.success(),
        "{}",
        String::from_utf8_lossy(&verify.stdout)
    );
    println!(
        "kill -9 soak: {cycles} cycles, {total_acked} acknowledged replies, {total_checked} checks after restarts, {} approvals pending, 0 lost, 0 double admissions",
        all_held.len()
    );
}
