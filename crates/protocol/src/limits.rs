//! Every bound the protocol enforces at parse time, unit last in the name. Reaching one is an
//! `invalid_field` (or `line_too_long`) refusal, never a truncation.

/// Default longest request line, excluding the `\n` (the server may configure another).
pub const LINE_BYTES_MAX_DEFAULT: usize = 64 * 1024;
/// Longest bearer or admission token.
pub const TOKEN_BYTES_MAX: usize = 256;
/// Longest `error` text on `complete`.
pub const ERROR_BYTES_MAX: usize = 4 * 1024;
/// The bounds the kernel also keeps (its `Limits::default()` is built from them): longest
/// free-text reason on `cancel`, `kill` and `decide`; largest `result` on `complete`, measured
/// as sent; most labels on a run and the bytes of a label's key and value. Defined once, in
/// the kernel, so what the protocol lets through the kernel's defaults accept.
pub use estop_kernel::limits::{
    LABEL_KEY_BYTES_MAX, LABEL_VALUE_BYTES_MAX, LABELS_MAX, REASON_BYTES_MAX, RESULT_BYTES_MAX,
    SPEND_TOKENS_MAX, SPEND_USD_MICROS_MAX,
};
/// Most approver groups on one token.
pub const GROUPS_MAX: usize = 16;
pub const GROUP_BYTES_MAX: usize = 64;

/// Longest `cursor` a listing accepts (the gate's own cursors are far shorter).
pub const CURSOR_BYTES_MAX: usize = 1024;

pub use crate::id::ID_BYTES_MAX;

#[cfg(test)]
mod tests {
    use super::*;
    use estop_kernel::Limits;

    /// A request the protocol lets through is within the kernel's default bounds: a run with
    /// the most labels, each at its longest, a longest reason, a largest result.
    #[test]
    fn what_the_protocol_accepts_the_kernel_defaults_accept() {
        let k = Limits::default();
        assert!(LABELS_MAX <= k.labels_max);
        assert!(LABEL_KEY_BYTES_MAX + LABEL_VALUE_BYTES_MAX <= k.label_bytes_max);
        assert!(REASON_BYTES_MAX <= k.reason_bytes_max);
        assert!(RESULT_BYTES_MAX <= k.result_bytes_max);
        assert!(ERROR_BYTES_MAX <= k.result_bytes_max);
    }
}
