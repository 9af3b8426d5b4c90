//! Every bound the protocol enforces at parse time, unit last in the name. Reaching one is an
//! `invalid_field` (or `line_too_long`) refusal, never a truncation.

/// Default longest request line, excluding the `\n` (the server may configure another).
pub const LINE_BYTES_MAX_DEFAULT: usize = 64 * 1024;
/// Longest bearer or admission token.
pub const TOKEN_BYTES_MAX: usize = 256;
/// Longest free-text reason on `cancel`, `kill` and `decide`.
pub const REASON_BYTES_MAX: usize = 1024;
/// Longest `error` text on `complete`.
pub const ERROR_BYTES_MAX: usize = 4 * 1024;
/// Largest `result` on `complete`, measured as sent.
pub const RESULT_BYTES_MAX: usize = 64 * 1024;
/// Most labels on a run.
pub const LABELS_MAX: usize = 16;
pub const LABEL_KEY_BYTES_MAX: usize = 64;
pub const LABEL_VALUE_BYTES_MAX: usize = 256;
/// Most approver groups on one token.
pub const GROUPS_MAX: usize = 16;
pub const GROUP_BYTES_MAX: usize = 64;

/// Longest `cursor` a listing accepts (the gate's own cursors are far shorter).
pub const CURSOR_BYTES_MAX: usize = 1024;

pub use crate::id::ID_BYTES_MAX;
