//! The policy file format (TOML): the serde schema, and the checks that turn it into a
//! [`Policy`] or refuse it with the line of the first problem.

use std::collections::HashMap;

use estop_kernel::ids::{NAME_BYTES_MAX, ToolName};
use estop_kernel::vocab::{EffectClass, PolicyAction, Reversibility};
use serde::Deserialize;
use serde::de::{Deserializer, Error as _};
use toml::Spanned;

use crate::duration;
use crate::pattern::ToolPattern;
use crate::when::Condition;
use crate::{Defaults, Policy, PolicyError, RULE_DEFAULT, RULE_UNKNOWN_TOOL, Rule};

/// Most approvers a rule may require.
pub const QUORUM_MAX: u32 = 32;
/// Most rules in one policy.
pub const RULES_MAX: usize = 10_000;
/// Largest policy file, in bytes.
pub const POLICY_BYTES_MAX: usize = 1 << 20;

/// Deserializes one of the kernel's closed vocabularies from its lowercase name.
macro_rules! vocab_de {
    ($de:ident, $ty:ty, $what:literal) => {
        #[derive(Clone, Copy)]
        struct $de($ty);
        impl<'de> Deserialize<'de> for $de {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                <$ty>::parse(&s).map($de).ok_or_else(|| {
                    let names: Vec<&str> = <$ty>::ALL.iter().map(|v| v.as_str()).collect();
                    D::Error::custom(format!(
                        "unknown {} {s:?}; expected one of {}",
                        $what,
                        names.join(", ")
                    ))
                })
            }
        }
    };
}

vocab_de!(ActionDe, PolicyAction, "action");
vocab_de!(ClassDe, EffectClass, "class");
vocab_de!(ReversibilityDe, Reversibility, "reversibility");

/// A duration string such as "15m", in milliseconds.
#[derive(Clone, Copy)]
struct DurationDe(u64);

impl<'de> Deserialize<'de> for DurationDe {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Text(String),
            Number(i64),
        }
        match Raw::deserialize(d)? {
            Raw::Text(s) => duration::parse_ms(&s)
                .map(DurationDe)
                .map_err(D::Error::custom),
            Raw::Number(n) => Err(D::Error::custom(format!(
                "a duration is a string with a unit, such as \"{n}s\" or \"{n}m\", not a bare number"
            ))),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    #[serde(default)]
    defaults: Option<RawDefaults>,
    #[serde(default)]
    rules: Vec<Spanned<RawRule>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawDefaults {
    unknown_tool: Option<ActionDe>,
    approval_expiry: Option<DurationDe>,
    quorum: Option<Spanned<i64>>,
    class: Option<ClassDe>,
    run_deadline: Option<DurationDe>,
    max_effects: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    tool: Spanned<String>,
    when: Option<Spanned<String>>,
    action: Spanned<ActionDe>,
    class: Option<ClassDe>,
    reversibility: Option<Spanned<ReversibilityDe>>,
    compensate: Option<Spanned<String>>,
    compensate_args: Option<Spanned<String>>,
    lookup: Option<Spanned<String>>,
    lookup_args: Option<Spanned<String>>,
    quorum: Option<Spanned<i64>>,
    groups: Option<Spanned<Vec<Spanned<String>>>>,
    expiry: Option<Spanned<DurationDe>>,
    name: Option<Spanned<String>>,
}

/// Turns byte offsets into 1-based line numbers.
struct Lines<'a> {
    origin: &'a str,
    /// Byte offset of every `\n`, ascending.
    newlines: Vec<usize>,
}

impl Lines<'_> {
    fn new<'a>(text: &str, origin: &'a str) -> Lines<'a> {
        let newlines = text
            .bytes()
            .enumerate()
            .filter(|&(_, b)| b == b'\n')
            .map(|(i, _)| i)
            .collect();
        Lines { origin, newlines }
    }

    fn line(&self, offset: usize) -> usize {
        self.newlines.partition_point(|&nl| nl < offset) + 1
    }

    fn err<T>(
        &self,
        span: std::ops::Range<usize>,
        reason: impl Into<String>,
    ) -> Result<T, PolicyError> {
        Err(PolicyError::Invalid {
            origin: self.origin.to_string(),
            line: self.line(span.start),
            reason: reason.into(),
        })
    }
}

fn check_quorum(lines: &Lines, q: &Spanned<i64>, key: &str) -> Result<u32, PolicyError> {
    match u32::try_from(*q.get_ref()) {
        Ok(n) if (1..=QUORUM_MAX).contains(&n) => Ok(n),
        _ => lines.err(
            q.span(),
            format!(
                "`{key}` is {}; it counts distinct approvers, from 1 to {QUORUM_MAX}",
                q.get_ref()
            ),
        ),
    }
}

/// Checks a rule or group name: non-empty, bounded, printable.
fn check_name(what: &str, s: &str) -> Result<(), String> {
    if s.trim().is_empty() {
        return Err(format!("{what} is empty"));
    }
    if s.len() > NAME_BYTES_MAX {
        return Err(format!(
            "{what} is {} bytes, longer than the limit of {NAME_BYTES_MAX}",
            s.len()
        ));
    }
    if s.chars().any(char::is_control) {
        return Err(format!("{what} contains a control character"));
    }
    Ok(())
}

pub(crate) fn parse(text: &str, origin: &str) -> Result<Policy, PolicyError> {
    if text.len() > POLICY_BYTES_MAX {
        return Lines::new("", origin).err(
            0..0,
            format!(
                "the policy is {} bytes, larger than the limit of {POLICY_BYTES_MAX}",
                text.len()
            ),
        );
    }
    let lines = Lines::new(text, origin);
    let raw: RawPolicy = toml::from_str(text).map_err(|e| PolicyError::Invalid {
        origin: origin.to_string(),
        line: e.span().map_or(1, |s| lines.line(s.start)),
        reason: e.message().trim_end().to_string(),
    })?;

    let defaults = build_defaults(&lines, raw.defaults)?;
    if raw.rules.len() > RULES_MAX {
        return lines.err(
            raw.rules[RULES_MAX].span(),
            format!(
                "the policy has {} rules, more than the limit of {RULES_MAX}",
                raw.rules.len()
            ),
        );
    }
    let env = crate::cel_env();
    let mut rules: Vec<Rule> = Vec::with_capacity(raw.rules.len());
    // Lookups only (never iterated), so a HashMap keeps loading linear without costing
    // determinism. Both map to the index of the earlier rule.
    let mut names: HashMap<std::sync::Arc<str>, usize> = HashMap::new();
    let mut unconditional_tools: HashMap<Box<str>, usize> = HashMap::new();
    let mut catch_all: Option<usize> = None;
    for (index, spanned) in raw.rules.into_iter().enumerate() {
        let line = lines.line(spanned.span().start);
        let rule = build_rule(&lines, &defaults, &env, index, line, spanned.into_inner())?;
        if let Some(&earlier) = names.get(&rule.name) {
            return lines.err(
                rule.name_span.clone(),
                format!(
                    "two rules are named {:?} (the other is at line {}); rule names must be unique",
                    rule.name, rules[earlier].line
                ),
            );
        }
        if let Some(earlier) =
            catch_all.or_else(|| unconditional_tools.get(&rule.tool_text).copied())
        {
            let earlier = &rules[earlier];
            return lines.err(
                rule.tool_span.clone(),
                format!(
                    "rule {:?} can never match: rule {:?} (line {}) has no `when` and matches \
                     every tool this one does, and the first matching rule wins; move this rule \
                     above it or remove it",
                    rule.name, earlier.name, earlier.line
                ),
            );
        }
        names.insert(rule.name.clone(), index);
        if rule.when.is_none() {
            if matches!(rule.pattern, ToolPattern::Any) {
                catch_all = Some(index);
            }
            unconditional_tools.insert(rule.tool_text.clone(), index);
        }
        rules.push(rule);
    }
    Ok(Policy::from_parts(defaults, rules))
}

fn build_defaults(lines: &Lines, raw: Option<RawDefaults>) -> Result<Defaults, PolicyError> {
    let mut d = Defaults::builtin();
    let Some(raw) = raw else { return Ok(d) };
    if let Some(a) = raw.unknown_tool {
        d.unknown_tool = a.0;
    }
    if let Some(e) = raw.approval_expiry {
        d.approval_expiry_ms = e.0;
    }
    if let Some(q) = &raw.quorum {
        d.quorum = check_quorum(lines, q, "quorum")?;
    }
    if let Some(c) = raw.class {
        d.class = c.0;
    }
    d.run_deadline_ms = raw.run_deadline.map(|e| e.0);
    if let Some(m) = &raw.max_effects {
        match u64::try_from(*m.get_ref()) {
            Ok(n) if n > 0 => d.run_effects_max = Some(n),
            _ => {
                return lines.err(
                    m.span(),
                    format!(
                        "`max_effects` is {}; it must be at least 1 (leave it out for no limit)",
                        m.get_ref()
                    ),
                );
            }
        }
    }
    Ok(d)
}

fn build_rule(
    lines: &Lines,
    defaults: &Defaults,
    env: &cel::Env,
    index: usize,
    line: usize,
    raw: RawRule,
) -> Result<Rule, PolicyError> {
    let (name, name_span) = match &raw.name {
        Some(n) => {
            check_name("the rule `name`", n.get_ref()).or_else(|e| lines.err(n.span(), e))?;
            let s = n.get_ref().as_str();
            if s == RULE_UNKNOWN_TOOL || s == RULE_DEFAULT {
                return lines.err(
                    n.span(),
                    format!(
                        "the rule name {s:?} is reserved for calls that match no rule; pick another"
                    ),
                );
            }
            (s.to_string(), n.span())
        }
        None => (format!("rule {}", index + 1), raw.tool.span()),
    };
    let tool_span = raw.tool.span();
    let pattern =
        ToolPattern::parse(raw.tool.get_ref()).or_else(|e| lines.err(tool_span.clone(), e))?;
    let when = match &raw.when {
        Some(w) => Some(Condition::compile(env, w.get_ref()).or_else(|e| lines.err(w.span(), e))?),
        None => None,
    };
    let action = raw.action.get_ref().0;
    let approve = action == PolicyAction::Approve;
    for (key, span) in [
        ("quorum", raw.quorum.as_ref().map(|q| q.span())),
        ("groups", raw.groups.as_ref().map(|g| g.span())),
        ("expiry", raw.expiry.as_ref().map(|e| e.span())),
    ] {
        if let (false, Some(span)) = (approve, span) {
            return lines.err(
                span,
                format!(
                    "`{key}` only applies to rules with action = \"approve\", and this one is {:?}; \
                     remove it or change the action",
                    action.as_str()
                ),
            );
        }
    }
    let quorum = match &raw.quorum {
        Some(q) => check_quorum(lines, q, "quorum")?,
        None if approve => defaults.quorum,
        None => 1,
    };
    let mut groups: Vec<String> = Vec::new();
    if let Some(g) = &raw.groups {
        for group in g.get_ref() {
            check_name("a group name", group.get_ref()).or_else(|e| lines.err(group.span(), e))?;
            if groups.iter().any(|seen| seen == group.get_ref()) {
                return lines.err(
                    group.span(),
                    format!("the group {:?} is listed twice", group.get_ref()),
                );
            }
            groups.push(group.get_ref().clone());
        }
        if groups.len() > quorum as usize {
            let span = raw.quorum.as_ref().map_or(g.span(), |q| q.span());
            return lines.err(
                span,
                format!(
                    "quorum {quorum} is smaller than the {} groups listed: each group needs its own \
                     approver, so set quorum = {} or more",
                    groups.len(),
                    groups.len()
                ),
            );
        }
    }
    let mut reversibility = raw
        .reversibility
        .as_ref()
        .map_or(Reversibility::Undeclared, |r| r.get_ref().0);
    let compensate = match &raw.compensate {
        None => None,
        Some(c) => {
            if action == PolicyAction::Deny {
                return lines.err(
                    c.span(),
                    "`compensate` on a deny rule means nothing: a denied call never runs, so there \
                     is nothing to undo; remove it",
                );
            }
            let tool = one_tool(lines, c, "compensate")?;
            match reversibility {
                Reversibility::Undeclared => reversibility = Reversibility::Compensable,
                Reversibility::Irreversible => {
                    let span = raw.reversibility.as_ref().map_or(c.span(), |r| r.span());
                    return lines.err(
                        span,
                        "the rule says reversibility = \"irreversible\" and also names a \
                         `compensate` tool; drop one of them",
                    );
                }
                Reversibility::Reversible | Reversibility::Compensable => {}
            }
            Some(tool)
        }
    };
    let compensate_args = match &raw.compensate_args {
        None => None,
        Some(m) if compensate.is_none() => {
            return lines.err(
                m.span(),
                "`compensate_args` without `compensate` builds arguments for no tool; name the \
                 compensating tool with `compensate`",
            );
        }
        Some(m) => {
            crate::mapping::Mapping::compile(env, m.get_ref())
                .or_else(|e| lines.err(m.span(), e))?;
            Some(std::sync::Arc::from(m.get_ref().as_str()))
        }
    };
    let lookup = match &raw.lookup {
        None => None,
        Some(l) if compensate.is_none() => {
            return lines.err(
                l.span(),
                "`lookup` without `compensate`: only the reverse saga looks an unknown outcome \
                 up, before undoing it; name the compensating tool with `compensate`",
            );
        }
        Some(l) => Some(one_tool(lines, l, "lookup")?),
    };
    let lookup_args = match (&raw.lookup_args, &lookup) {
        (None, _) => None,
        (Some(m), None) => {
            return lines.err(
                m.span(),
                "`lookup_args` without `lookup` builds arguments for no tool; name the lookup \
                 tool with `lookup`",
            );
        }
        (Some(m), Some(_)) => {
            crate::mapping::Mapping::compile_as(env, "lookup_args", m.get_ref())
                .or_else(|e| lines.err(m.span(), e))?;
            Some(std::sync::Arc::from(m.get_ref().as_str()))
        }
    };
    if let (Some(l), Some(tool)) = (&raw.lookup, &lookup) {
        check_http_lookup(
            lines,
            l.span(),
            tool,
            raw.tool.get_ref(),
            lookup_args.is_some(),
        )?;
    }
    Ok(Rule {
        name: name.into(),
        name_span,
        tool_text: raw.tool.get_ref().as_str().into(),
        tool_span,
        pattern,
        when,
        action,
        class: raw.class.as_ref().map_or(defaults.class, |c| c.0),
        class_by_rule: raw.class.is_some(),
        reversibility,
        compensate,
        compensate_args,
        lookup,
        lookup_args,
        quorum,
        groups,
        expiry_ms: raw
            .expiry
            .map_or(defaults.approval_expiry_ms, |e| e.get_ref().0),
        line,
        when_after: false,
    })
}

/// An HTTP lookup (`lookup = "http.GET"`, run by `estop egress-executor` with the credential
/// store): only of HTTP effects (the rule's tool is `http.*`), since the lookup goes to the
/// forward call's own origin (scheme, host, port: its `lookup_args` names only the path and
/// headers), so the credentials it carries are that host's and no other's; and only with a
/// `lookup_args` saying which path finds the call. Not `CONNECT`, which reaches nothing.
fn check_http_lookup(
    lines: &Lines<'_>,
    span: std::ops::Range<usize>,
    lookup: &ToolName,
    forward: &str,
    mapped: bool,
) -> Result<(), PolicyError> {
    let Some(method) = lookup.as_str().strip_prefix("http.") else {
        return Ok(());
    };
    if method == "CONNECT" || method.is_empty() {
        return lines.err(
            span,
            format!("`lookup = \"http.{method}\"` is not a request an executor sends"),
        );
    }
    if !forward.starts_with("http.") || forward.starts_with("http.CONNECT") {
        return lines.err(
            span,
            format!(
                "an HTTP lookup ({lookup}) only looks up HTTP requests (tool = \"http.*\"), on \
                 the forward request's own host; this rule is for {forward:?}"
            ),
        );
    }
    if !mapped {
        return lines.err(
            span,
            format!(
                "an HTTP lookup ({lookup}) needs `lookup_args` saying which path finds the call, \
                 e.g. '{{\"path\": \"/v1/orders?idempotency_key=\" + key}}'"
            ),
        );
    }
    Ok(())
}

/// A rule's key naming one tool (`compensate`, `lookup`): a valid name, not a pattern.
fn one_tool(lines: &Lines<'_>, c: &Spanned<String>, key: &str) -> Result<ToolName, PolicyError> {
    ToolName::new(c.get_ref())
        .map_err(|e| e.to_string())
        .and_then(|t| {
            if t.as_str().contains(['*', '?']) {
                Err("it names one tool, not a pattern".to_string())
            } else {
                Ok(t)
            }
        })
        .or_else(|e| lines.err(c.span(), format!("bad `{key}` {:?}: {e}", c.get_ref())))
}
