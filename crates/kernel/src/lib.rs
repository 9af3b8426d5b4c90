//! estop kernel: the pure per-run state machine and admission logic.
//! No IO, no clock (time is an argument), no threads, no randomness; same inputs, same outputs.
pub mod ids;
pub mod vocab;
