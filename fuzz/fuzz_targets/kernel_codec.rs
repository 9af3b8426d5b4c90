//! The kernel's record and snapshot decoders never panic; what decodes re-encodes to bytes that
//! decode to the same value; the recovery decoder, sharing what repeats, decodes exactly alike.
#![no_main]

use estop_kernel::Limits;
use estop_kernel::record_codec::{
    RecordDecoder, decode_record, decode_snapshot, encode_record, encode_snapshot,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let alone = decode_record(data);
    // The second decode of the same bytes takes every shared path the first one primed.
    let mut decoder = RecordDecoder::default();
    assert_eq!(decoder.decode(data), alone, "recovery decoder, cold");
    assert_eq!(decoder.decode(data), alone, "recovery decoder, primed");
    if let Ok(rec) = alone {
        let mut buf = Vec::new();
        encode_record(&rec, &mut buf);
        assert_eq!(decode_record(&buf).as_ref(), Ok(&rec), "record round trip");
    }
    if let Ok(gate) = decode_snapshot(data, Limits::default()) {
        let mut buf = Vec::new();
        encode_snapshot(&gate, &mut buf);
        assert_eq!(
            decode_snapshot(&buf, Limits::default()).as_ref(),
            Ok(&gate),
            "snapshot round trip"
        );
    }
});
