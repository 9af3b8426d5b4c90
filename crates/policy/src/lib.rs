//! estop policy: the server-side rules that decide what happens to a proposed effect.
//!
//! A policy is a TOML file of rules (see `docs/POLICY.md`). Each rule matches a tool-name glob
//! and, optionally, a CEL condition (`when`) over `tool`, `args` and `principal`; the first
//! matching rule decides allow / approve / deny, the effect's class, reversibility, compensating
//! tool, and for approvals the quorum, approver groups and expiry. Nothing the agent sends can
//! weaken a decision (G7): the agent may only [`Ruling::strengthen`] it.
//!
//! Evaluation is pure and deterministic (no clock, no IO), so the same call under the same
//! policy always gets the same [`Ruling`]. The server records the ruling in the ledger; replay
//! uses the recorded ruling, never a re-evaluation.
//!
//! ```
//! use estop_kernel::{ToolName, vocab::PolicyAction};
//! use estop_policy::Policy;
//! use serde_json::json;
//!
//! let policy = Policy::parse(r#"
//!     [[rules]]
//!     tool = "refund"
//!     when = "args.amount > 100"
//!     action = "approve"
//!     quorum = 2
//!     name = "big-refunds"
//!
//!     [[rules]]
//!     tool = "refund"
//!     action = "allow"
//! "#)?;
//! let refund = ToolName::new("refund").unwrap();
//!
//! let mut ruling = policy.evaluate(&refund, Some(&json!({"amount": 150.5})), "agent")?;
//! assert_eq!((ruling.action, ruling.quorum, &*ruling.rule), (PolicyAction::Approve, 2, "big-refunds"));
//!
//! ruling = policy.evaluate(&refund, Some(&json!({"amount": 20})), "agent")?;
//! assert_eq!(ruling.action, PolicyAction::Allow);
//! ruling.strengthen(true); // the agent asked for approval
//! assert_eq!(ruling.action, PolicyAction::Approve);
//!
//! // Hiding the arguments cannot skip the condition.
//! let err = policy.evaluate(&refund, None, "agent").unwrap_err();
//! assert_eq!(err.code(), "policy_args_required");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod duration;
mod error;
mod file;
mod mapping;
mod pattern;
mod when;

use std::path::Path;
use std::sync::{Arc, OnceLock};

use estop_kernel::ids::ToolName;
use estop_kernel::vocab::{EffectClass, PolicyAction, Reversibility};
use estop_kernel::{PolicyDecision, RunLimits};

pub use duration::{DURATION_MS_MAX, parse_ms as parse_duration_ms};
pub use error::{EvalError, PolicyError};
pub use file::{POLICY_BYTES_MAX, QUORUM_MAX, RULES_MAX};
pub use mapping::{Mapping, compensation_args, lookup_args};
pub use pattern::ToolPattern;
pub use when::{ARGS_DEPTH_MAX, WHEN_BYTES_MAX};

use when::{Condition, Scope};

/// The `rule` of a ruling when a policy with rules has none that matches the tool.
pub const RULE_UNKNOWN_TOOL: &str = "unknown_tool";
/// The `rule` of a ruling from a policy that has no rules at all (no policy file, or
/// [`Policy::allow_all`]).
pub const RULE_DEFAULT: &str = "default";

/// Approval expiry when the file does not say: 15 minutes.
pub const APPROVAL_EXPIRY_MS_DEFAULT: u64 = 15 * 60 * 1000;

/// The `[defaults]` table, resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Defaults {
    /// What happens to a tool no rule matches.
    pub unknown_tool: PolicyAction,
    /// Expiry of approvals whose rule does not set `expiry`.
    pub approval_expiry_ms: u64,
    /// Quorum of approve rules that do not set `quorum`.
    pub quorum: u32,
    /// Class of rules that do not set `class` (unmatched tools are always `write`).
    pub class: EffectClass,
    /// Per-run deadline, counted from the run's creation; `None` = no deadline.
    pub run_deadline_ms: Option<u64>,
    /// Most effects one run may admit; `None` = no limit.
    pub run_effects_max: Option<u64>,
}

impl Defaults {
    fn builtin() -> Defaults {
        Defaults {
            unknown_tool: PolicyAction::Approve,
            approval_expiry_ms: APPROVAL_EXPIRY_MS_DEFAULT,
            quorum: 1,
            class: EffectClass::Write,
            run_deadline_ms: None,
            run_effects_max: None,
        }
    }
}

/// One compiled rule.
#[derive(Debug)]
struct Rule {
    /// Shared with every ruling the rule gives (one copy of the name, no allocation per call).
    name: Arc<str>,
    name_span: std::ops::Range<usize>,
    tool_text: Box<str>,
    tool_span: std::ops::Range<usize>,
    pattern: ToolPattern,
    when: Option<Condition>,
    action: PolicyAction,
    class: EffectClass,
    /// Whether the rule says `class` itself (else `class` is `defaults.class`).
    class_by_rule: bool,
    reversibility: Reversibility,
    compensate: Option<ToolName>,
    compensate_args: Option<Arc<str>>,
    lookup: Option<ToolName>,
    lookup_args: Option<Arc<str>>,
    quorum: u32,
    groups: Vec<String>,
    expiry_ms: u64,
    /// 1-based line of the rule's `[[rules]]` table.
    line: usize,
    /// Whether a later rule has a `when` (so the walk must go on after a match to find out
    /// whether this tool has a conditional rule).
    when_after: bool,
}

impl Rule {
    fn ruling(&self) -> Ruling {
        Ruling {
            action: self.action,
            class: self.class,
            class_by_rule: self.class_by_rule,
            reversibility: self.reversibility,
            compensate: self.compensate.clone(),
            compensate_args: self.compensate_args.clone(),
            lookup: self.lookup.clone(),
            lookup_args: self.lookup_args.clone(),
            quorum: self.quorum,
            groups: self.groups.clone(),
            expiry_ms: self.expiry_ms,
            rule: self.name.clone(),
            matched: true,
            conditional: false,
            strengthened: false,
        }
    }
}

/// What the policy says about one call. Record it with the admission: it is the decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ruling {
    pub action: PolicyAction,
    pub class: EffectClass,
    /// Whether the deciding rule says `class` itself (false: `defaults.class`, or `write` for a
    /// tool no rule matches). Only a class no rule set can be seeded ([`Ruling::seed`]).
    pub class_by_rule: bool,
    pub reversibility: Reversibility,
    /// The tool that undoes this one, if the rule names one.
    pub compensate: Option<ToolName>,
    /// How its arguments are built from the forward call (`compensate_args`, CEL text).
    pub compensate_args: Option<Arc<str>>,
    /// The tool that finds out whether a call of unknown outcome happened, by its
    /// idempotency key (`lookup`).
    pub lookup: Option<ToolName>,
    /// How the lookup's arguments are built from the forward call (`lookup_args`, CEL text).
    pub lookup_args: Option<Arc<str>>,
    /// Distinct approvers needed (meaningful when `action` is approve; 1 otherwise).
    pub quorum: u32,
    /// Groups that must each supply at least one of the approvers (approve only).
    pub groups: Vec<String>,
    /// How long an approval request stays open (meaningful when `action` is approve; for
    /// allow it is the default expiry, used if the agent strengthens the ruling).
    pub expiry_ms: u64,
    /// The deciding rule's name, or [`RULE_UNKNOWN_TOOL`] / [`RULE_DEFAULT`].
    pub rule: Arc<str>,
    /// Whether a rule matched (false for [`RULE_UNKNOWN_TOOL`] and [`RULE_DEFAULT`]).
    pub matched: bool,
    /// Whether any rule whose glob matches this tool has a `when` (so a digest-only admit of
    /// this tool is refused).
    pub conditional: bool,
    /// Whether [`Ruling::strengthen`] turned an allow into an approve.
    pub strengthened: bool,
}

impl Ruling {
    /// Applies the agent's `needs_approval`: an allow becomes an approve with quorum 1, no
    /// groups and the ruling's expiry (the policy default). Deny and approve are never changed,
    /// and `needs_approval = false` changes nothing: the agent can strengthen, never weaken.
    pub fn strengthen(&mut self, needs_approval: bool) {
        if needs_approval && self.action == PolicyAction::Allow {
            self.action = PolicyAction::Approve;
            self.quorum = 1;
            self.groups.clear();
            self.strengthened = true;
        }
    }

    /// Applies an agent's `seed` (an MCP gateway's reading of a trusted server's annotations):
    /// it fills only what no rule set, and only where it makes the call more guarded, because
    /// any agent can send one. A `write` seed turns a class left to `defaults.class = "read"`
    /// into `write` (it then waits behind the run's pending approvals, G1); an `irreversible`
    /// seed fills a reversibility no rule or declaration gave. A `read` seed or an undoable
    /// reversibility never lowers anything: they would let an agent's word take a call out of
    /// the G1 hold or promise an undo nobody configured. A rule's `class`/`reversibility` wins.
    pub fn seed(&mut self, class: Option<EffectClass>, reversibility: Option<Reversibility>) {
        if class == Some(EffectClass::Write) && !self.class_by_rule {
            self.class = EffectClass::Write;
        }
        if reversibility == Some(Reversibility::Irreversible)
            && self.reversibility == Reversibility::Undeclared
            && self.compensate.is_none()
        {
            self.reversibility = Reversibility::Irreversible;
        }
    }
}

/// A client's own declaration of how a call is undone, sent with its admission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Declared {
    pub reversibility: Option<Reversibility>,
    pub compensate: Option<ToolName>,
    /// `compensate_args` (CEL text), as in a policy rule.
    pub compensate_args: Option<String>,
}

impl Ruling {
    /// Adds a client's declaration to the ruling. It may only add to what policy says, never
    /// take away or contradict it: a compensation the policy names stays (another tool is
    /// refused), a mapping the policy gives stays, and a call policy calls irreversible cannot
    /// be declared undoable. Where policy said nothing, the client's word is recorded. The
    /// error says what conflicts; the caller refuses the admission and records nothing.
    pub fn declare(&mut self, d: &Declared) -> Result<(), String> {
        if let Some(tool) = &d.compensate {
            if tool.as_str().contains(['*', '?']) {
                return Err(format!("compensate {tool:?} names one tool, not a pattern"));
            }
            match &self.compensate {
                Some(required) if required != tool => {
                    return Err(format!(
                        "policy rule {:?} compensates this call with {required}; a client \
                         cannot replace it with {tool}",
                        self.rule
                    ));
                }
                _ => {}
            }
            if self.reversibility == Reversibility::Irreversible
                || d.reversibility == Some(Reversibility::Irreversible)
            {
                return Err(
                    "an irreversible call has no compensation: drop compensate or the \
                     irreversible declaration"
                        .into(),
                );
            }
        }
        if let Some(source) = &d.compensate_args {
            if d.compensate.is_none() && self.compensate.is_none() {
                return Err("compensate_args without a compensating tool".into());
            }
            if self.compensate_args.is_some() {
                return Err(format!(
                    "policy rule {:?} already says how the compensation's arguments are built",
                    self.rule
                ));
            }
            mapping::Mapping::compile(&cel_env(), source)?;
        }
        if let Some(r) = d.reversibility
            && self.reversibility != Reversibility::Undeclared
            && self.reversibility != r
        {
            return Err(format!(
                "policy rule {:?} declares the call {}; a client cannot declare it {r}",
                self.rule, self.reversibility
            ));
        }
        // Everything checked: now add.
        if let Some(tool) = &d.compensate {
            self.compensate = Some(tool.clone());
        }
        if let Some(source) = &d.compensate_args {
            self.compensate_args = Some(Arc::from(source.as_str()));
        }
        if let Some(r) = d.reversibility {
            self.reversibility = r;
        }
        if self.compensate.is_some() && self.reversibility == Reversibility::Undeclared {
            self.reversibility = Reversibility::Compensable;
        }
        Ok(())
    }
}

/// The kernel's record of the decision: what the server stores with the admission, so replay
/// and later policy edits never change it.
impl From<Ruling> for PolicyDecision {
    fn from(v: Ruling) -> PolicyDecision {
        PolicyDecision {
            action: v.action,
            class: v.class,
            reversibility: v.reversibility,
            compensate: v.compensate,
            compensate_args: v.compensate_args,
            lookup: v.lookup,
            lookup_args: v.lookup_args,
            quorum: v.quorum,
            groups: v.groups.into_iter().map(String::into_boxed_str).collect(),
            expiry_ms: v.expiry_ms,
            rule: v.rule,
        }
    }
}

/// The shared CEL environment (standard library and macros), built once per process.
pub(crate) fn cel_env() -> Arc<cel::Env> {
    static ENV: OnceLock<Arc<cel::Env>> = OnceLock::new();
    Arc::clone(ENV.get_or_init(|| Arc::new(cel::Env::stdlib())))
}

/// A loaded, checked policy. Cheap to share (`Send + Sync`); evaluating does not mutate it.
pub struct Policy {
    defaults: Defaults,
    rules: Vec<Rule>,
    env: Arc<cel::Env>,
    /// Ruling for tools no rule matches.
    fallback: Ruling,
}

impl std::fmt::Debug for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Policy")
            .field("defaults", &self.defaults)
            .field(
                "rules",
                &self.rules.iter().map(|r| &r.name).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Default for Policy {
    /// No rules: every tool needs one approval, expiring after 15 minutes.
    fn default() -> Policy {
        Policy::from_parts(Defaults::builtin(), Vec::new())
    }
}

impl Policy {
    fn from_parts(defaults: Defaults, mut rules: Vec<Rule>) -> Policy {
        let mut later_when = false;
        for rule in rules.iter_mut().rev() {
            rule.when_after = later_when;
            later_when |= rule.when.is_some();
        }
        let fallback = Ruling {
            action: defaults.unknown_tool,
            class: EffectClass::Write,
            class_by_rule: false,
            reversibility: Reversibility::Undeclared,
            compensate: None,
            compensate_args: None,
            lookup: None,
            lookup_args: None,
            quorum: if defaults.unknown_tool == PolicyAction::Approve {
                defaults.quorum
            } else {
                1
            },
            groups: Vec::new(),
            expiry_ms: defaults.approval_expiry_ms,
            rule: if rules.is_empty() {
                RULE_DEFAULT
            } else {
                RULE_UNKNOWN_TOOL
            }
            .into(),
            matched: false,
            conditional: false,
            strengthened: false,
        };
        Policy {
            defaults,
            rules,
            env: cel_env(),
            fallback,
        }
    }

    /// Parses and checks a policy. A bad policy is refused whole, with the line of the problem.
    pub fn parse(text: &str) -> Result<Policy, PolicyError> {
        file::parse(text, "policy")
    }

    /// Reads and parses a policy file (at most [`POLICY_BYTES_MAX`] bytes).
    pub fn load(path: &Path) -> Result<Policy, PolicyError> {
        use std::io::Read;
        let unreadable = |reason: String| PolicyError::Unreadable {
            path: path.to_path_buf(),
            reason,
        };
        let file = std::fs::File::open(path).map_err(|e| unreadable(e.to_string()))?;
        let mut text = String::new();
        file.take(POLICY_BYTES_MAX as u64 + 1)
            .read_to_string(&mut text)
            .map_err(|e| unreadable(e.to_string()))?;
        if text.len() > POLICY_BYTES_MAX {
            return Err(unreadable(format!(
                "it is larger than the limit of {POLICY_BYTES_MAX} bytes"
            )));
        }
        file::parse(&text, &path.display().to_string())
    }

    /// Every tool allowed, class write, no conditions: for benchmarks and tests.
    pub fn allow_all() -> Policy {
        let defaults = Defaults {
            unknown_tool: PolicyAction::Allow,
            ..Defaults::builtin()
        };
        Policy::from_parts(defaults, Vec::new())
    }

    /// The resolved `[defaults]` table (including per-run limits).
    pub fn defaults(&self) -> &Defaults {
        &self.defaults
    }

    /// The per-run limits of a run created at `now_ms` (Unix ms): the deadline is absolute.
    pub fn run_limits(&self, now_ms: u64) -> RunLimits {
        RunLimits {
            deadline_at: self
                .defaults
                .run_deadline_ms
                .map(|d| now_ms.saturating_add(d)),
            max_effects: self.defaults.run_effects_max,
            // Policy has no model budget of its own; a run's is the one its creator asks for.
            max_spend: None,
            max_tokens: None,
        }
    }

    /// Number of rules.
    pub fn rules_len(&self) -> usize {
        self.rules.len()
    }

    /// Decides one call. `args` is `None` when the agent sent only the digest of its arguments.
    /// `principal` is the name of the agent token that proposes the call.
    ///
    /// Rules are tried in file order; the first whose glob matches `tool` and whose `when` (if
    /// any) is true decides. No match gives `defaults.unknown_tool` with class write and
    /// reversibility undeclared. Errors fail closed: the caller refuses the effect.
    pub fn evaluate(
        &self,
        tool: &ToolName,
        args: Option<&serde_json::Value>,
        principal: &str,
    ) -> Result<Ruling, EvalError> {
        let name = tool.as_str();
        let mut scope: Option<Scope> = None;
        let mut conditional = false;
        let mut decided: Option<usize> = None;
        for (index, rule) in self.rules.iter().enumerate() {
            if !rule.pattern.matches(name) {
                continue;
            }
            let Some(condition) = &rule.when else {
                decided = Some(index);
                break;
            };
            conditional = true;
            let Some(args) = args else {
                return Err(EvalError::ArgsRequired {
                    tool: name.to_string(),
                    rule: rule.name.to_string(),
                });
            };
            let failed = |message: String| EvalError::WhenFailed {
                rule: rule.name.to_string(),
                message,
            };
            let ctx = match &scope {
                Some(ctx) => ctx,
                None => scope.insert(Scope::new(&self.env, name, args, principal).map_err(failed)?),
            };
            if condition.eval(ctx).map_err(failed)? {
                decided = Some(index);
                break;
            }
        }
        let Some(index) = decided else {
            return Ok(Ruling {
                conditional,
                ..self.fallback.clone()
            });
        };
        let rule = &self.rules[index];
        // Only a digest-only admit must know whether a later rule is conditional (to refuse it);
        // with arguments, the scan just sets the flag. Glob-only policies never get here.
        if rule.when_after
            && !conditional
            && let Some(later) = self.rules[index + 1..]
                .iter()
                .find(|r| r.when.is_some() && r.pattern.matches(name))
        {
            if args.is_none() {
                return Err(EvalError::ArgsRequired {
                    tool: name.to_string(),
                    rule: later.name.to_string(),
                });
            }
            conditional = true;
        }
        Ok(Ruling {
            conditional,
            ..rule.ruling()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn policy_is_shareable_across_threads() {
        assert_send_sync::<Policy>();
    }
}
