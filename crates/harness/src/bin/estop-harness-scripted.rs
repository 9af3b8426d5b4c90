//! A scripted OpenAI-compatible server (the tests' and the README's stand-in for a model
//! provider): `estop-harness-scripted --script FILE [--listen ADDR]` serves the n-th response
//! of the script (JSON: `{"responses": [[step, …], …]}`) to the n-th call and prints
//! `ready url=http://ADDR/v1` once it listens. Not part of the product.

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let Some(path) = flag("--script") else {
        eprintln!("usage: estop-harness-scripted --script FILE [--listen ADDR]");
        return std::process::ExitCode::from(2);
    };
    let listen = flag("--listen").unwrap_or_else(|| "127.0.0.1:0".into());
    let script: estop_harness::scripted::Script = match std::fs::read(&path)
        .map_err(|e| e.to_string())
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
    {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{path}: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let server = match estop_harness::scripted::Scripted::start(&listen, script).await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("cannot listen on {listen}: {e}");
                return std::process::ExitCode::from(1);
            }
        };
        println!("ready url={}", server.base_url());
        std::future::pending::<()>().await;
        std::process::ExitCode::SUCCESS
    })
}
