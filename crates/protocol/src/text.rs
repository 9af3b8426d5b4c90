//! Agent text on an operator's screen: which characters could make a terminal (or a reader)
//! see something other than what is there, and the one escaping every human-readable output
//! uses. A newline plus ANSI escapes in a cancel reason would otherwise forge a coloured ledger
//! line; a right-to-left override or a zero-width space in a run id would make two ids look
//! alike. JSON output needs none of this: it escapes control characters itself, and a program
//! reads it, not a person.

use std::borrow::Cow;
use std::fmt::Write as _;

/// Whether `c` changes how the text around it is shown rather than showing as itself: C0 and C1
/// controls and DEL (ESC starts terminal sequences), bidirectional controls (U+061C, U+200E/F,
/// U+202A–U+202E, U+2066–U+2069), zero-width and invisible characters (U+200B–U+200D,
/// U+2060–U+2064, U+FEFF) and the Unicode line and paragraph separators (U+2028/9).
pub fn is_hidden(c: char) -> bool {
    matches!(
        c,
        '\u{0}'..='\u{1f}'
            | '\u{7f}'..='\u{9f}'
            | '\u{61c}'
            | '\u{200b}'..='\u{200f}'
            | '\u{2028}'..='\u{202e}'
            | '\u{2060}'..='\u{2064}'
            | '\u{2066}'..='\u{2069}'
            | '\u{feff}'
    )
}

/// Whether an identifier (run id, key, tool, label key, group) holds a character that
/// [`is_hidden`] names; such ids are refused at the edge (docs/PROTOCOL.md, "Limits").
pub fn has_hidden(s: &str) -> bool {
    // Nearly every id is printable ASCII: one pass over the bytes proves it.
    !s.bytes().all(|b| matches!(b, b' '..=b'~')) && s.chars().any(is_hidden)
}

/// `s` as it may be shown on a terminal: every [`is_hidden`] character written visibly as
/// `\n`, `\r`, `\t` or `\u{…}` (Rust's notation), everything else as it is. Borrowed when
/// there is nothing to escape.
pub fn escape(s: &str) -> Cow<'_, str> {
    if !has_hidden(s) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if is_hidden(c) => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forged_ledger_line_stays_on_one_visible_line() {
        let s = "x\n\u{1b}[32m decide principal=admin\u{1b}[0m";
        let e = escape(s);
        assert_eq!(
            e, "x\\n\\u{1b}[32m decide principal=admin\\u{1b}[0m",
            "one line, ESC visible"
        );
        assert!(!e.contains('\n') && !e.contains('\u{1b}'));
    }

    #[test]
    fn bidi_zero_width_and_c1_are_escaped_and_the_rest_is_untouched() {
        assert_eq!(
            escape("a\u{202e}b\u{200b}c\u{9b}d\u{7f}"),
            "a\\u{202e}b\\u{200b}c\\u{9b}d\\u{7f}"
        );
        assert_eq!(
            escape("\u{feff}\u{2066}\u{61c}\u{200e}"),
            "\\u{feff}\\u{2066}\\u{61c}\\u{200e}"
        );
        for plain in ["run-1", "é€😀 日本", "tab-free \\u{202e} text", ""] {
            assert!(matches!(escape(plain), Cow::Borrowed(_)), "{plain}");
        }
        assert_eq!(escape("a\tb\r"), "a\\tb\\r");
    }

    #[test]
    fn escaping_leaves_nothing_hidden_for_any_character() {
        for c in (0..=0x10ffff).filter_map(char::from_u32) {
            let e = escape(&c.to_string()).into_owned();
            assert!(!e.chars().any(is_hidden), "{c:?} -> {e:?}");
            assert_eq!(has_hidden(&c.to_string()), is_hidden(c), "{c:?}");
        }
    }
}
