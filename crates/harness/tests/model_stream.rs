//! The model stream parser under random bytes: whatever a provider (or a hostile one) streams,
//! split anywhere, the accumulator never holds more than its bounds allow after any chunk —
//! the unfinished event, the tool calls and their bytes, the whole reply — and scans in linear
//! time (`model::parse_stream` asserts each after every chunk); a reply it hands out is within
//! the bounds too.

use estop_harness::chat::{Overflow, Reply};
use estop_harness::model::{Bounds, parse_stream};
use proptest::prelude::*;
use serde_json::json;

/// One piece of a stream: a realistic event (text, a tool call delta with any index, usage, a
/// finish, `[DONE]`), a separator, or random bytes.
fn piece() -> impl Strategy<Value = Vec<u8>> {
    let text = "[a-z \\n\"{}]{0,80}";
    prop_oneof![
        text.prop_map(|t| {
            let c = json!({"choices": [{"delta": {"content": t}}]});
            format!("data: {c}\n\n").into_bytes()
        }),
        (0u64..40, "[a-z]{0,3}", text).prop_map(|(index, id, args)| {
            let c = json!({"choices": [{"delta": {"tool_calls": [
                {"index": index, "id": id, "function": {"name": "t", "arguments": args}}
            ]}}]});
            format!("data: {c}\n\n").into_bytes()
        }),
        any::<u64>().prop_map(|index| {
            let c = json!({"choices": [{"delta": {"tool_calls": [{"index": index}]}}]});
            format!("data: {c}\n\n").into_bytes()
        }),
        prop_oneof![Just("stop"), Just("tool_calls"), Just("length")].prop_map(|f| {
            let c = json!({"choices": [{"delta": {}, "finish_reason": f}]});
            format!("data: {c}\n\n").into_bytes()
        }),
        Just(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9}}\r\n\r\n".to_vec()),
        Just(b"data: [DONE]\n\n".to_vec()),
        Just(b"\n\n".to_vec()),
        Just(b": keep-alive\n\n".to_vec()),
        proptest::collection::vec(any::<u8>(), 0..200),
    ]
}

fn bounds() -> impl Strategy<Value = Bounds> {
    (1usize..10, 16usize..600, 4usize..200, 64usize..6000).prop_map(|(c, e, t, r)| Bounds {
        tool_calls_max: c,
        event_bytes_max: e,
        tool_call_bytes_max: t,
        response_bytes_max: r,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn random_streams_never_hold_more_than_the_bounds(
        b in bounds(),
        pieces in proptest::collection::vec(piece(), 0..60),
        cuts in proptest::collection::vec(1usize..97, 1..40),
    ) {
        let body: Vec<u8> = pieces.concat();
        // Split the body at the cut lengths, cycling through them.
        let mut chunks = Vec::new();
        let (mut at, mut k) = (0, 0);
        while at < body.len() {
            let n = cuts[k % cuts.len()].min(body.len() - at);
            chunks.push(&body[at..at + n]);
            at += n;
            k += 1;
        }
        let reply = parse_stream(b, chunks.iter().copied());
        match reply {
            Reply::Finished { tool_calls, text, .. } => {
                prop_assert!(tool_calls.len() <= b.tool_calls_max);
                for c in &tool_calls {
                    let bytes = c.id.len() + c.function.name.len() + c.function.arguments.len();
                    prop_assert!(bytes <= b.tool_call_bytes_max);
                }
                prop_assert!(text.len() <= b.response_bytes_max);
            }
            Reply::Overflow { overflow, .. } => match overflow {
                Overflow::ToolCalls { index, max } => {
                    prop_assert_eq!(max, b.tool_calls_max);
                    prop_assert!(index >= max as u64);
                }
                Overflow::EventBytes { max } => prop_assert_eq!(max, b.event_bytes_max),
                Overflow::ToolCallBytes { max, .. } => prop_assert_eq!(max, b.tool_call_bytes_max),
                Overflow::ResponseBytes { max } => {
                    prop_assert_eq!(max, b.response_bytes_max);
                    prop_assert!(body.len() > max);
                }
            },
            Reply::Failed { .. } | Reply::Cut { .. } => {}
        }
    }
}
