//! Prints the cost of `Policy::evaluate` (target: a glob-only policy of ~20 rules well under
//! 1 µs, so the gate can admit 100k effects/s). Run: `cargo bench -p estop-policy`.

use std::hint::black_box;
use std::time::Instant;

use estop_kernel::ids::ToolName;
use estop_policy::Policy;

fn glob_policy() -> String {
    let mut text = String::from("[defaults]\nunknown_tool = \"approve\"\n");
    for i in 0..18 {
        let (tool, action) = match i % 3 {
            0 => (format!("tool_{i}"), "allow"),
            1 => (format!("prefix_{i}_*"), "approve"),
            _ => (format!("*_suffix_{i}"), "allow"),
        };
        text.push_str(&format!(
            "[[rules]]\ntool = \"{tool}\"\naction = \"{action}\"\n"
        ));
    }
    text.push_str("[[rules]]\ntool = \"s?arch*\"\naction = \"allow\"\nclass = \"read\"\n");
    text.push_str("[[rules]]\ntool = \"drop_*\"\naction = \"deny\"\n");
    text
}

fn measure(label: &str, iterations: u32, mut f: impl FnMut()) {
    for _ in 0..iterations / 10 {
        f();
    }
    let start = Instant::now();
    for _ in 0..iterations {
        f();
    }
    let ns = start.elapsed().as_nanos() as f64 / f64::from(iterations);
    println!("{label:<52} {ns:>9.0} ns/eval  ({:.0}k evals/s)", 1e6 / ns);
}

fn main() {
    let policy = Policy::parse(&glob_policy()).expect("bench policy parses");
    let args = serde_json::json!({"amount": 150.5, "customer": {"tier": "gold"}});
    for name in ["tool_0", "search_web", "drop_table", "unmatched_tool"] {
        let tool = ToolName::new(name).expect("valid name");
        measure(&format!("20 glob rules, tool {name}"), 1_000_000, || {
            black_box(policy.evaluate(black_box(&tool), Some(&args), "agent").ok());
        });
    }

    let conditional = Policy::parse(
        "[[rules]]\ntool = \"refund\"\nwhen = \"args.amount > 100 && args.customer.tier == 'gold'\"\naction = \"approve\"\n[[rules]]\ntool = \"refund\"\naction = \"allow\"\n",
    )
    .expect("bench policy parses");
    let tool = ToolName::new("refund").expect("valid name");
    measure("1 CEL rule (args with 2 fields)", 200_000, || {
        black_box(
            conditional
                .evaluate(black_box(&tool), Some(&args), "agent")
                .ok(),
        );
    });

    let mut text = String::new();
    for i in 0..1000 {
        text.push_str(&format!(
            "[[rules]]\ntool = \"t{i}*\"\nwhen = \"args.n > 1\"\naction = \"allow\"\n"
        ));
    }
    let start = Instant::now();
    let policy = Policy::parse(&text).expect("bench policy parses");
    let ms = start.elapsed().as_secs_f64() * 1e3;
    println!(
        "parse {} rules with a `when` each: {ms:.1} ms",
        policy.rules_len()
    );
}
