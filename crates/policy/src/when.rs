//! `when` conditions: CEL programs compiled once at load time and evaluated against
//! `tool`, `args` and `principal`.
//!
//! JSON numbers keep their kind: an integer that fits `i64` becomes a CEL `int`, a larger
//! non-negative one a `uint`, anything else a `double`. The `cel` crate compares numbers across
//! `int`, `uint` and `double` by value (`100.5 > 100`, `101 > 100.0`, `100 == 100.0` all hold), so
//! a condition does not care whether the agent's JSON encoder wrote `101` or `101.0`. Arithmetic
//! does not mix kinds: `args.amount + 1` with a `double` amount is an evaluation error, which
//! fails closed; write `double(args.amount) + 1.0`.

use std::collections::HashMap;
use std::sync::Arc;

use cel::{Context, Env, ExecutionError, Program, Value};

/// Longest `when` expression, in bytes.
pub const WHEN_BYTES_MAX: usize = 4096;

/// Deepest nesting of `args` accepted for a condition (serde_json's own parse limit is 128).
pub const ARGS_DEPTH_MAX: usize = 128;

/// Longest error message kept from a failed evaluation, in bytes (it may quote argument values).
const MESSAGE_BYTES_MAX: usize = 400;

/// A compiled `when`.
#[derive(Debug)]
pub struct Condition {
    program: Program,
}

impl Condition {
    /// Compiles `source`; the error says where in the expression it went wrong.
    pub fn compile(env: &Env, source: &str) -> Result<Condition, String> {
        if source.trim().is_empty() {
            return Err(
                "`when` is empty; remove it or write a condition such as \"args.amount > 100\""
                    .into(),
            );
        }
        if source.len() > WHEN_BYTES_MAX {
            return Err(format!(
                "`when` is {} bytes, longer than the limit of {WHEN_BYTES_MAX}",
                source.len()
            ));
        }
        match env.compile(source) {
            Ok(program) => Ok(Condition { program }),
            Err(errors) => {
                let detail = match errors.errors.first() {
                    Some(e) => format!(
                        "at expression line {}, column {}: {}",
                        e.pos.0, e.pos.1, e.msg
                    ),
                    None => errors.to_string(),
                };
                Err(format!("`when` {source:?} does not compile {detail}"))
            }
        }
    }

    /// Evaluates the condition. Anything but a boolean result is an error (fail closed).
    pub fn eval(&self, scope: &Scope) -> Result<bool, String> {
        match self.program.execute(&scope.context) {
            Ok(Value::Bool(b)) => Ok(b),
            Ok(other) => Err(bounded(format!(
                "the condition returned {} {other:?}, not a bool; write a comparison such as \
                 \"args.amount > 100\"",
                other.type_of()
            ))),
            Err(e) => Err(bounded(explain(&e))),
        }
    }
}

fn explain(e: &ExecutionError) -> String {
    let hint = match e {
        ExecutionError::NoSuchKey(_) => {
            "; the arguments lack this field: guard it with has(args.field) or \"field\" in args"
        }
        ExecutionError::UnsupportedBinaryOperator(..) => {
            "; arithmetic needs both sides of one number kind: wrap them in double(...)"
        }
        ExecutionError::UndeclaredReference(_) => "; the variables are tool, args and principal",
        _ => "",
    };
    format!("{e}{hint}")
}

fn bounded(mut message: String) -> String {
    if message.len() > MESSAGE_BYTES_MAX {
        let mut cut = MESSAGE_BYTES_MAX;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
        message.push('…');
    }
    message
}

/// The variables of one evaluation, built once per `evaluate` and only when a matching rule
/// has a `when`.
pub struct Scope {
    context: Context<'static, 'static>,
}

impl Scope {
    pub fn new(
        env: &Arc<Env>,
        tool: &str,
        args: &serde_json::Value,
        principal: &str,
    ) -> Result<Scope, String> {
        let mut context = Context::with_env(Arc::clone(env));
        context.add_variable_from_value("tool", tool);
        context.add_variable_from_value("principal", principal);
        context.add_variable_from_value("args", json_to_cel(args, 0)?);
        Ok(Scope { context })
    }
}

/// Converts JSON into a CEL value, keeping the kind of each number (see the module docs).
pub fn json_to_cel(value: &serde_json::Value, depth: usize) -> Result<Value, String> {
    use serde_json::Value as J;
    if depth > ARGS_DEPTH_MAX {
        return Err(format!(
            "the arguments nest deeper than {ARGS_DEPTH_MAX} levels"
        ));
    }
    Ok(match value {
        J::Null => Value::Null,
        J::Bool(b) => Value::Bool(*b),
        J::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::Int(i)
            } else if let Some(u) = n.as_u64() {
                Value::UInt(u)
            } else if let Some(f) = n.as_f64() {
                Value::Float(f)
            } else {
                return Err(format!("the number {n} in the arguments is out of range"));
            }
        }
        J::String(s) => Value::String(Arc::new(s.clone())),
        J::Array(items) => Value::List(Arc::new(
            items
                .iter()
                .map(|v| json_to_cel(v, depth + 1))
                .collect::<Result<Vec<_>, _>>()?,
        )),
        J::Object(fields) => {
            let mut map = HashMap::with_capacity(fields.len());
            for (k, v) in fields {
                map.insert(k.clone(), json_to_cel(v, depth + 1)?);
            }
            Value::from(map)
        }
    })
}
