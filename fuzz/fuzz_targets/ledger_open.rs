//! Ledger recovery on arbitrary bytes: the input is split into a segment file and (optionally) a
//! snapshot file; `Ledger::open` and `verify` must answer (ok, torn tail truncated, or a typed
//! refusal) and never panic. When open succeeds, every delivered record has the next seq.
#![no_main]

use estop_ledger::{CrashStorage, Ledger, LedgerOptions, Storage, format};
use libfuzzer_sys::fuzz_target;
use std::sync::Arc;

fuzz_target!(|data: &[u8]| {
    let disk = CrashStorage::new(1);
    let (seg, snap) = match data.first() {
        Some(&n) if n & 1 == 1 && data.len() > 2 => {
            let cut = 1 + (usize::from(data[1]) * (data.len() - 1)) / 256;
            (&data[cut..], Some(&data[1..cut]))
        }
        _ => (data.get(1..).unwrap_or(&[]), None),
    };
    disk.put(&format::segment_name(1), seg.to_vec());
    if let Some(s) = snap {
        disk.put(&format::snapshot_name(1), s.to_vec());
    }
    let storage: Arc<dyn Storage> = Arc::new(disk.clone());
    let _ = estop_ledger::verify(&*storage);
    let mut last = None::<u64>;
    let r = Ledger::open(
        storage,
        LedgerOptions {
            record_bytes_max: 1 << 16,
            ..LedgerOptions::default()
        },
        |_, _| Ok::<(), String>(()),
        |seq, _| {
            if let Some(l) = last {
                assert_eq!(seq, l + 1, "records are delivered in seq order");
            }
            last = Some(seq);
            Ok::<(), String>(())
        },
    );
    if let Ok(rec) = r {
        assert_eq!(rec.report.last_seq + 1, rec.ledger.next_seq());
    }
});
