//! The harness's model stream parser (`estop_harness::model::parse_stream`: SSE events, their
//! JSON chunks, tool call deltas) never panics and never holds more than its bounds, whatever
//! the bytes and wherever they are split: `parse_stream` asserts the bounds and the linear scan
//! after every chunk, and a reply it hands out is within them.
#![no_main]

use estop_harness::chat::Reply;
use estop_harness::model::{Bounds, parse_stream};
use libfuzzer_sys::fuzz_target;

const SMALL: Bounds = Bounds {
    tool_calls_max: 4,
    event_bytes_max: 512,
    tool_call_bytes_max: 128,
    response_bytes_max: 4096,
};

fuzz_target!(|data: &[u8]| {
    for (bounds, step) in [(Bounds::default(), 7), (SMALL, 1), (SMALL, 64)] {
        let reply = parse_stream(bounds, data.chunks(step));
        if let Reply::Finished { tool_calls, .. } = reply {
            assert!(tool_calls.len() <= bounds.tool_calls_max);
            for c in &tool_calls {
                let bytes = c.id.len() + c.function.name.len() + c.function.arguments.len();
                assert!(bytes <= bounds.tool_call_bytes_max);
            }
        }
    }
});
