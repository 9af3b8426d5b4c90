//! The MCP gateway's stdio framing (`estop mcp`, crates/mcp `sep1686::pump`): newline-delimited
//! JSON-RPC from an untrusted client (and server), each line rewritten for 2025-11-25 tasks or
//! passed unchanged. Never a panic, and the framing holds: one line out per line in, a line
//! that is not rewritten passes byte for byte, a rewritten one is JSON; the HTTP side's
//! per-frame rewrite (`outbound_frame`, SSE `data:` lines) keeps the frame's lines.
#![no_main]

use estop_mcp::sep1686::{CALL, CANCEL, GET, inbound, outbound, outbound_frame, pump};
use libfuzzer_sys::fuzz_target;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime")
    })
}

/// `pump` over `data` with `rewrite`: what it wrote.
fn pumped(data: &[u8], rewrite: impl Fn(&[u8]) -> Option<Vec<u8>>) -> Vec<u8> {
    let mut out = Vec::new();
    runtime().block_on(pump(data, &mut out, rewrite));
    out
}

fuzz_target!(|data: &[u8]| {
    // Nothing rewritten: the bytes pass exactly.
    assert_eq!(pumped(data, |_| None), data);
    let lines_in = data.split(|b| *b == b'\n').count();
    for (dir, out) in [
        ("in", pumped(data, |m| inbound(m, &|id: &str| id.len() % 2 == 0))),
        ("out", pumped(data, outbound)),
    ] {
        assert_eq!(out.split(|b| *b == b'\n').count(), lines_in, "{dir}");
    }
    for line in data.split(|b| *b == b'\n') {
        if let Some(m) = inbound(line, &|_| true) {
            let v: serde_json::Value = serde_json::from_slice(&m).expect("JSON");
            assert!([CALL, GET, CANCEL].contains(&v["method"].as_str().unwrap_or("")));
        }
        if let Some(m) = outbound(line) {
            serde_json::from_slice::<serde_json::Value>(&m).expect("JSON");
        }
    }
    if let Some(frame) = outbound_frame(data) {
        // A JSON body is one message; an SSE frame keeps its lines.
        if serde_json::from_slice::<serde_json::Value>(&frame).is_err() {
            assert_eq!(frame.split(|b| *b == b'\n').count(), lines_in);
        }
    }
});
