//! Human output: agent-supplied text escaped for a terminal, and aligned tables.

use std::borrow::Cow;

/// Agent-supplied text as it may reach a terminal: control, bidi and zero-width characters
/// shown escaped (`\u{202e}`), so a reason cannot forge a line or disguise an id. Every human
/// output goes through it (`--json` prints exact JSON instead).
pub fn esc(text: &str) -> Cow<'_, str> {
    estop_protocol::text::escape(text)
}

/// `esc`, owned: a table cell.
pub fn cell(text: &str) -> String {
    esc(text).into_owned()
}

/// At most `n` characters of `s`, escaped (escaping first, so an escape is never cut short).
pub fn truncate(s: &str, n: usize) -> String {
    let s = esc(s);
    if s.chars().count() <= n {
        s.into_owned()
    } else {
        format!("{}…", s.chars().take(n).collect::<String>())
    }
}

/// The wall clock in Unix ms (how long an approval has left).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Prints `rows` under `header`, each column as wide as its widest cell, or `(none)`.
pub fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(esc(c).chars().count());
        }
    }
    let line = |cells: &[String]| {
        let out: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{:<w$}", esc(c), w = widths[i]))
            .collect();
        println!("{}", out.join("  ").trim_end());
    };
    line(&header.iter().map(|h| (*h).to_string()).collect::<Vec<_>>());
    for r in rows {
        line(r);
    }
    if rows.is_empty() {
        println!("(none)");
    }
}
