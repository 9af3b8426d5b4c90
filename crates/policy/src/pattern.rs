//! Tool-name patterns: globs where `*` matches any run of characters and `?` one character.
//! The common shapes (exact, `prefix*`, `*suffix`, `*middle*`, `*`) are matched without the
//! general glob engine, so a glob-only policy is evaluated in a few string comparisons.

use estop_kernel::ids::NAME_BYTES_MAX;
use wildmatch::WildMatch;

/// A compiled tool-name pattern. Matching is case-sensitive.
#[derive(Debug, Clone)]
pub enum ToolPattern {
    Any,
    Exact(Box<str>),
    Prefix(Box<str>),
    Suffix(Box<str>),
    Contains(Box<str>),
    Glob(WildMatch),
}

impl ToolPattern {
    /// Compiles a pattern, refusing what is surely a mistake: an empty pattern, control
    /// characters, over-long patterns, and the bracket/brace syntax of other glob dialects
    /// (which would silently match nothing here).
    pub fn parse(text: &str) -> Result<ToolPattern, String> {
        if text.is_empty() {
            return Err("`tool` is empty; write a tool name or a glob such as \"search*\"".into());
        }
        if text.len() > NAME_BYTES_MAX {
            return Err(format!(
                "`tool` is {} bytes, longer than the limit of {NAME_BYTES_MAX}",
                text.len()
            ));
        }
        if text.chars().any(char::is_control) {
            return Err("`tool` contains a control character".into());
        }
        if let Some(c) = text.chars().find(|c| matches!(c, '[' | ']' | '{' | '}')) {
            return Err(format!(
                "`tool` pattern {text:?} contains {c:?}: only `*` (any characters) and `?` \
                 (one character) are wildcards; list alternatives as separate rules"
            ));
        }
        let wild = |c: char| c == '*' || c == '?';
        if !text.contains(wild) {
            return Ok(ToolPattern::Exact(text.into()));
        }
        if text.chars().all(|c| c == '*') {
            return Ok(ToolPattern::Any);
        }
        if !text.contains('?') {
            let inner = text.trim_matches('*');
            if !inner.contains('*') {
                let lead = text.starts_with('*');
                let trail = text.ends_with('*');
                return Ok(match (lead, trail) {
                    (false, true) => ToolPattern::Prefix(inner.into()),
                    (true, false) => ToolPattern::Suffix(inner.into()),
                    _ => ToolPattern::Contains(inner.into()),
                });
            }
        }
        Ok(ToolPattern::Glob(WildMatch::new(text)))
    }

    pub fn matches(&self, tool: &str) -> bool {
        match self {
            ToolPattern::Any => true,
            ToolPattern::Exact(s) => tool == &**s,
            ToolPattern::Prefix(s) => tool.starts_with(&**s),
            ToolPattern::Suffix(s) => tool.ends_with(&**s),
            ToolPattern::Contains(s) => tool.contains(&**s),
            ToolPattern::Glob(g) => g.matches(tool),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ToolPattern;

    fn m(pattern: &str, tool: &str) -> bool {
        ToolPattern::parse(pattern).unwrap().matches(tool)
    }

    #[test]
    fn shapes_match_like_the_glob_engine() {
        let tools = [
            "",
            "search",
            "search_web",
            "web_search",
            "research",
            "refund",
            "re",
            "s",
        ];
        let patterns = [
            "*", "**", "search", "search*", "*search", "*search*", "s?arch*", "re*und", "*e*r*",
            "?", "??", "re?", "*_*",
        ];
        for p in patterns {
            let glob = wildmatch::WildMatch::new(p);
            for t in tools {
                assert_eq!(m(p, t), glob.matches(t), "pattern {p:?} tool {t:?}");
            }
        }
        assert!(matches!(
            ToolPattern::parse("a*").unwrap(),
            ToolPattern::Prefix(_)
        ));
        assert!(matches!(
            ToolPattern::parse("*a").unwrap(),
            ToolPattern::Suffix(_)
        ));
        assert!(matches!(
            ToolPattern::parse("*a*").unwrap(),
            ToolPattern::Contains(_)
        ));
        assert!(matches!(
            ToolPattern::parse("a").unwrap(),
            ToolPattern::Exact(_)
        ));
        assert!(matches!(
            ToolPattern::parse("a*b").unwrap(),
            ToolPattern::Glob(_)
        ));
    }

    #[test]
    fn matching_is_case_sensitive() {
        assert!(!m("Search*", "search"));
    }

    #[test]
    fn refuses_mistakes() {
        assert!(ToolPattern::parse("").is_err());
        assert!(
            ToolPattern::parse("db_[rw]")
                .unwrap_err()
                .contains("only `*`")
        );
        assert!(ToolPattern::parse("{a,b}").is_err());
        assert!(ToolPattern::parse("a\tb").is_err());
        assert!(ToolPattern::parse(&"x".repeat(201)).is_err());
    }
}
