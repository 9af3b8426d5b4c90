//! The protocol v1 request parser and the SoundGate line parser never panic, whatever the bytes;
//! a parsed request is a complete typed value.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(req) = estop_protocol::parse_request(data) {
        let _ = format!("{req:?}");
    }
    let _ = estop_protocol::parse_soundgate(data);
});
