//! The daemon's log: one line per event on stderr, with a UTC timestamp. Secrets never go here.

use std::time::{SystemTime, UNIX_EPOCH};

fn line(level: &str, msg: &str) {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
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
