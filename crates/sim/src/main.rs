//! `estop-sim`: the long modes of the proof harnesses (docs/TESTING.md).
//!
//! ```text
//! estop-sim diff  [--ops N] [--seed S] [--len L]   differential conformance, kernel vs model
//! estop-sim check [--depth D] [--states N]         bounded model checking with trace properties
//! estop-sim sim   [--seeds N] [--seed S] [--steps K] deterministic simulation with crashes
//! ```

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
        Some("sim") => {
            let steps = arg(&args, "--steps").unwrap_or(3_000);
            let seeds: Vec<u64> =
                match estop_sim::rng::env_u64("ESTOP_SIM_SEED").or(arg(&args, "--seed")) {
                    Some(s) => vec![s],
                    None => {
                        let first = arg(&args, "--first").unwrap_or(0);
                        (first..first + arg(&args, "--seeds").unwrap_or(10_000)).collect()
                    }
                };
            let (mut crashes, mut acked, mut recoveries, mut torn) = (0u64, 0u64, 0u64, 0u64);
            for (i, seed) in seeds.iter().enumerate() {
                match estop_sim::sim::run_seed(*seed, steps) {
                    Ok(r) => {
                        crashes += r.kills + r.power_losses;
                        acked += r.acked;
                        recoveries += r.recoveries;
                        torn += r.torn_tails;
                        if seeds.len() == 1 || i % 1000 == 0 {
                            println!("{r}");
                        }
                    }
                    Err(e) => {
                        eprintln!("{e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            println!(
                "simulation: {} seeds x {steps} steps, {crashes} crashes, {recoveries} recoveries ({torn} torn tails), {acked} acknowledged replies audited, {:.1}s",
                seeds.len(),
                started.elapsed().as_secs_f64()
            );
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("usage: estop-sim diff|check|sim [options] (see docs/TESTING.md)");
            ExitCode::from(2)
        }
    }
}
