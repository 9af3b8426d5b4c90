//! The daemon's log: one line per event on stderr, with a UTC timestamp. Secrets never go here.
//! A message may quote what a client sent: it is escaped like the CLI's tables, so it stays one
//! line and cannot colour or reorder the operator's terminal.

use std::time::{SystemTime, UNIX_EPOCH};

fn line(level: &str, msg: &str) {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let msg = estop_protocol::text::escape(msg);
    eprintln!("{}.{:03} {level} {msg}", ms / 1000, ms % 1000);
}

pub fn info(msg: &str) {
    line("INFO", msg);
}

pub fn warn(msg: &str) {
    line("WARN", msg);
}

pub fn error(msg: &str) {
    line("ERROR", msg);
}
