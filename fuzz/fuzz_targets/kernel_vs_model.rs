//! Kernel operation sequences against the reference model: every 8 input bytes choose one op of
//! the small world (crates/sim); after every op the answers and the observable states must agree,
//! and at the end the recorded commands must replay to the same state.
#![no_main]

use estop_sim::diff::{Pair, explain, random_op};
use estop_sim::rng::Rng;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut pair = Pair::tight();
    let mut ops = Vec::new();
    for chunk in data.chunks_exact(8).take(400) {
        let seed = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        let op = random_op(&mut Rng::new(seed), &pair.model);
        ops.push(op);
        if pair.step(&op).is_err() {
            panic!("kernel and model diverge:\n{}", explain(&ops));
        }
    }
    if let Err(e) = pair.check_replay() {
        panic!("replay: {e}\n{}", explain(&ops));
    }
});
