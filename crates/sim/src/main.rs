//! `estop-sim`: the long modes of the proof harnesses (docs/TESTING.md).
//!
//! ```text
//! estop-sim diff  [--ops N] [--seed S] [--len L]   differential conformance, kernel vs model
//! estop-sim check [--depth D] [--states N] [--ends|--saga] bounded model checking with trace properties
//! ```
//!
//! The simulation of the shipped path runs as a test: `ESTOP_SHIPPED_SEEDS=<n> cargo nextest run
//! -p estop-sim --test shipped` (docs/SIMULATION.md).

use std::process::ExitCode;

fn arg(args: &[String], name: &str) -> Option<u64> {
    let i = args.iter().position(|a| a == name)?;
    let v = args.get(i + 1)?;
    match v.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => v.replace('_', "").parse::<f64>().ok().map(|f| f as u64),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let started = std::time::Instant::now();
    match args.get(1).map(String::as_str) {
        Some("diff") => {
            let ops = arg(&args, "--ops").unwrap_or(100_000_000);
            let seed = arg(&args, "--seed").unwrap_or(0);
            let len = arg(&args, "--len").unwrap_or(200) as usize;
            if let Some(s) = estop_sim::rng::env_u64("ESTOP_DIFF_SEED") {
                let mut stats = estop_sim::diff::DiffStats::default();
                return match estop_sim::diff::run_case(s, len, &mut stats) {
                    Ok(()) => {
                        println!("seed {s}: {} ops agree", stats.ops);
                        ExitCode::SUCCESS
                    }
                    Err(d) => {
                        eprintln!("{}", d.report);
                        ExitCode::FAILURE
                    }
                };
            }
            match estop_sim::diff::run(seed, ops, len) {
                Ok(stats) => {
                    println!(
                        "differential: {} ops in {} cases agree (seeds {seed}..{}), {:.1}s",
                        stats.ops,
                        stats.cases,
                        seed + stats.cases,
                        started.elapsed().as_secs_f64()
                    );
                    for (k, n) in &stats.answers {
                        println!("  {k:<32} {n}");
                    }
                    ExitCode::SUCCESS
                }
                Err(d) => {
                    eprintln!("{}", d.report);
                    ExitCode::FAILURE
                }
            }
        }
        Some("check") => {
            let opts = estop_sim::check::CheckOptions {
                depth_max: arg(&args, "--depth").unwrap_or(u64::MAX) as usize,
                states_max: arg(&args, "--states").unwrap_or(u64::MAX),
                ticks_max: arg(&args, "--ticks").unwrap_or(3),
                crash: !args.iter().any(|a| a == "--no-crash"),
                alphabet: if args.iter().any(|a| a == "--ends") {
                    estop_sim::check::Alphabet::Ends
                } else if args.iter().any(|a| a == "--saga") {
                    estop_sim::check::Alphabet::Saga
                } else {
                    estop_sim::check::Alphabet::Approvals
                },
                plant: None,
            };
            match estop_sim::check::explore(&opts) {
                Ok(s) => {
                    println!(
                        "model check: {} states, {} transitions, depth {}{}, {} ledger recoveries + {} torn-tail recoveries checked, {:.1}s",
                        s.states,
                        s.transitions,
                        s.depth,
                        if s.exhaustive {
                            " (exhaustive)"
                        } else {
                            " (bounded)"
                        },
                        s.recoveries,
                        s.torn_recoveries,
                        started.elapsed().as_secs_f64()
                    );
                    ExitCode::SUCCESS
                }
                Err(v) => {
                    eprintln!("{v}");
                    ExitCode::FAILURE
                }
            }
        }
        Some("corpus") => {
            // Seeds for the fuzz corpora: real records, snapshots and segments of a random trace.
            let dir = std::path::PathBuf::from(
                args.get(2).cloned().unwrap_or_else(|| "fuzz/corpus".into()),
            );
            let mut pair = estop_sim::diff::Pair::new();
            let mut rng = estop_sim::rng::Rng::new(7);
            for _ in 0..60 {
                let op = estop_sim::diff::random_op(&mut rng, &pair.model);
                let _ = pair.step(&op);
            }
            let write = |sub: &str, name: String, bytes: &[u8]| {
                let d = dir.join(sub);
                std::fs::create_dir_all(&d).expect("corpus dir");
                std::fs::write(d.join(name), bytes).expect("corpus file");
            };
            let mut seg = estop_ledger::format::encode_segment_header(1).to_vec();
            for (i, rec) in pair.log.iter().enumerate().take(8) {
                let mut b = Vec::new();
                estop_kernel::record_codec::encode_record(rec, &mut b);
                write("kernel_codec", format!("record-{i}"), &b);
                estop_ledger::format::append_record(&mut seg, i as u64 + 1, &b, crc32c::crc32c(&b));
            }
            let mut snap = Vec::new();
            estop_kernel::record_codec::encode_snapshot(&pair.gate, &mut snap);
            write("kernel_codec", "snapshot".into(), &snap);
            write(
                "ledger_open",
                "segment".into(),
                &[&[0u8][..], &seg].concat(),
            );
            let mut torn = seg.clone();
            torn.truncate(seg.len() - 5);
            write("ledger_open", "torn".into(), &[&[0u8][..], &torn].concat());
            let mut with_snap = vec![1u8, 64];
            with_snap.extend_from_slice(&estop_ledger::format::encode_snapshot_header(
                1,
                &snap[..snap.len().min(40)],
            ));
            with_snap.extend_from_slice(&seg);
            write("ledger_open", "snapshot".into(), &with_snap);
            let mut ops = Vec::new();
            for i in 0..64u64 {
                ops.extend_from_slice(&(i * 0x9E37_79B9).to_le_bytes());
            }
            write("kernel_vs_model", "ops".into(), &ops);
            let lines: &[&str] = &[
                r#"{"id":1,"op":"hello","token":"secret"}"#,
                r#"{"id":2,"op":"admit","run":"r","key":"k","tool":"pay","args":{"a":[1,2.5,"x",null,true]}}"#,
                r#"{"id":"s","op":"admit","run":"r","key":"k","tool":"t","digest":"8833f3bd12786d1bfb0512eb3624a0de38e845d906c110a4bab60af53bbd1b96","start":false,"parent":"p","labels":{"a":"b"},"limits":{"timeout_ms":5}}"#,
                r#"{"id":3,"op":"decide","run":"r","key":"k","decision":"approve"}"#,
                r#"{"id":4,"op":"complete","run":"r","key":"k","token":"1.1","outcome":"ok","result":{"x":1}}"#,
                r#"{"id":5,"op":"wait","run":"r","key":"k","timeout_ms":100}"#,
                r#"{"op":"submit","run_id":"r1","effect_key":"send","needs_approval":true}"#,
                r#"{"op":"decide","run_id":"r1","effect_key":"send","approved":true,"mac":"00"}"#,
            ];
            for (i, l) in lines.iter().enumerate() {
                write("protocol_request", format!("line-{i}"), l.as_bytes());
            }
            println!("corpus written to {}", dir.display());
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("usage: estop-sim diff|check|corpus [options] (see docs/TESTING.md)");
            ExitCode::from(2)
        }
    }
}
