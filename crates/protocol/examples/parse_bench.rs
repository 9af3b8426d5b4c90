//! Prints how many admit lines per second one core parses (digest included) and how many
//! verdict replies it renders: the protocol's share of the gate's 100k admits/s budget.
//!
//! Run: `cargo run --release -p estop-protocol --example parse_bench`

use std::hint::black_box;
use std::time::Instant;

use estop_protocol::server_line::ok_line;
use estop_protocol::{Id, Op, VerdictReply, parse_request};

fn main() {
    let lines: Vec<Vec<u8>> = (0..1000)
        .map(|i| {
            format!(
                r#"{{"id":{i},"op":"admit","run":"run-{r}","key":"step-{i}:http.post","tool":"http.post","args":{{"url":"https://api.example.com/v1/charges","method":"POST","body":{{"amount":1999,"currency":"usd","customer":"cus_{i}"}},"retries":3}},"labels":{{"tenant":"acme"}}}}"#,
                r = i % 17
            )
            .into_bytes()
        })
        .collect();
    let rounds = 200;
    let n = lines.len() * rounds;

    let t0 = Instant::now();
    for _ in 0..rounds {
        for line in &lines {
            let req = parse_request(line).expect("bench lines parse");
            assert!(matches!(req.op, Op::Admit(_)));
            black_box(req);
        }
    }
    let parse = t0.elapsed();

    // The same work split: canonical JSON + SHA-256 alone, on already-parsed args.
    let parsed: Vec<(estop_kernel::ids::ToolName, serde_json::Value)> = lines
        .iter()
        .map(|l| match parse_request(l).expect("parse").op {
            Op::Admit(a) => (a.tool, a.args.expect("args")),
            _ => unreachable!("admit lines"),
        })
        .collect();
    let t2 = Instant::now();
    for _ in 0..rounds {
        for (tool, args) in &parsed {
            black_box(estop_protocol::digest_of(tool, args));
        }
    }
    let digest = t2.elapsed();
    println!(
        "digest alone: {:.2} µs each",
        digest.as_secs_f64() * 1e6 / n as f64
    );

    let verdict = VerdictReply::Admitted {
        token: "t.0123456789abcdef0123456789abcdef".into(),
        epoch: 0,
    };
    let t1 = Instant::now();
    for i in 0..n as u64 {
        black_box(ok_line(&Id::from_u64(i), &verdict));
    }
    let render = t1.elapsed();

    println!(
        "admit parse+digest: {:.0} lines/s ({:.2} µs each, {} B/line); verdict render: {:.0} replies/s",
        n as f64 / parse.as_secs_f64(),
        parse.as_secs_f64() * 1e6 / n as f64,
        lines[0].len(),
        n as f64 / render.as_secs_f64()
    );
}
