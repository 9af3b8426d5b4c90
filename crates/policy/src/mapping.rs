//! `compensate_args`: the CEL expression that builds a compensating call's arguments from the
//! forward call's `args` and its recorded `result` (SPEC §4.8). It is compiled when the policy
//! loads (a typo is a load error, not a failed undo at cancel time), recorded as text with each
//! admission, and evaluated by the shell only when the saga reaches the effect, so a policy
//! edited later never changes how an admitted effect is undone.
//!
//! Variables: `args` (the forward call's arguments), `result` (its recorded result parsed as
//! JSON, or the text itself when it is not JSON; `null` when none was reported), `tool` (the
//! forward tool). The expression must give a map, which becomes the compensating call's JSON
//! arguments, e.g. `{"charge_id": result.id, "amount": args.amount}`.

use std::sync::Arc;

use cel::{Context, Env, Program, Value};

use crate::when::{WHEN_BYTES_MAX, json_to_cel};

/// A compiled `compensate_args` (or `lookup_args`: the same kind of mapping, naming the
/// lookup's arguments).
#[derive(Debug)]
pub struct Mapping {
    program: Program,
    /// The rule's key, for errors.
    what: &'static str,
}

impl Mapping {
    /// Compiles `source` as a `compensate_args`; the error says what is wrong with it.
    pub fn compile(env: &Env, source: &str) -> Result<Mapping, String> {
        Mapping::compile_as(env, "compensate_args", source)
    }

    /// Compiles `source` as the rule's key `what`; the error says what is wrong with it.
    pub fn compile_as(env: &Env, what: &'static str, source: &str) -> Result<Mapping, String> {
        if source.trim().is_empty() {
            return Err(format!(
                "`{what}` is empty; remove it or write a map such as {{\"id\": result.id}}"
            ));
        }
        if source.len() > WHEN_BYTES_MAX {
            return Err(format!(
                "`{what}` is {} bytes, longer than the limit of {WHEN_BYTES_MAX}",
                source.len()
            ));
        }
        env.compile(source)
            .map(|program| Mapping { program, what })
            .map_err(|e| format!("`{what}` {source:?} does not compile: {e}"))
    }

    /// The compensating call's arguments for one forward call. Anything but a map of JSON
    /// values is an error (the saga then asks a human rather than guess).
    pub fn eval(
        &self,
        env: &Arc<Env>,
        tool: &str,
        args: &serde_json::Value,
        result: Option<&str>,
    ) -> Result<serde_json::Value, String> {
        let result = match result {
            None => serde_json::Value::Null,
            Some(text) => serde_json::from_str(text)
                .unwrap_or_else(|_| serde_json::Value::String(text.to_string())),
        };
        self.eval_vars(
            env,
            &[
                ("tool", serde_json::json!(tool)),
                ("args", args.clone()),
                ("result", result),
            ],
        )
    }

    /// Evaluates with these variables (JSON values); anything but a map is an error.
    fn eval_vars(
        &self,
        env: &Arc<Env>,
        vars: &[(&str, serde_json::Value)],
    ) -> Result<serde_json::Value, String> {
        let what = self.what;
        let mut context = Context::with_env(Arc::clone(env));
        for (name, value) in vars {
            context.add_variable_from_value(*name, json_to_cel(value, 0)?);
        }
        let value = self
            .program
            .execute(&context)
            .map_err(|e| format!("`{what}` failed: {e}"))?;
        match value {
            Value::Map(_) => cel_to_json(&value, 0),
            other => Err(format!(
                "`{what}` gave {}, not a map of arguments",
                other.type_of()
            )),
        }
    }
}

/// Evaluates a recorded `lookup_args` text: the lookup's arguments, from the forward call's
/// `args`, its `tool`, its idempotency `key` and `idempotency_key` (for a request the proxy
/// admitted, the `Idempotency-Key` it carried, else null; there is no `result`: the outcome is what
/// the lookup finds out). For an HTTP lookup (`lookup` = `http.METHOD`) the mapping names only
/// the `path` (with its query), and may add `headers` and `not_found` (the statuses that mean
/// the call did not happen); the URL is the forward request's own origin (its `scheme`, `host`,
/// `port`) and that path, so the lookup, and the credentials the executor injects for its host,
/// go nowhere else. A mapping giving `url`, `host`, `scheme` or `port` is refused.
pub fn lookup_args(
    source: &str,
    tool: &str,
    args: &serde_json::Value,
    key: &str,
    lookup: &str,
) -> Result<serde_json::Value, String> {
    let env = crate::cel_env();
    // The proxy keys a request that carried `Idempotency-Key: V` as `idem:V`: `V` is what the
    // upstream knows it by (null when the proxy derived the key).
    let sent = key.strip_prefix("idem:");
    let mapped = Mapping::compile_as(&env, "lookup_args", source)?.eval_vars(
        &env,
        &[
            ("tool", serde_json::json!(tool)),
            ("args", args.clone()),
            ("key", serde_json::json!(key)),
            ("idempotency_key", serde_json::json!(sent)),
        ],
    )?;
    if lookup.starts_with("http.") {
        http_lookup(mapped, args)
    } else {
        Ok(mapped)
    }
}

/// An HTTP lookup's request: the mapped `path` on the forward request's origin.
fn http_lookup(
    mut mapped: serde_json::Value,
    forward: &serde_json::Value,
) -> Result<serde_json::Value, String> {
    let m = mapped.as_object_mut().expect("a mapping gives a map");
    if let Some(k) = m
        .keys()
        .find(|k| !matches!(k.as_str(), "path" | "headers" | "not_found"))
    {
        return Err(format!(
            "`lookup_args` gave {k:?}: an HTTP lookup names its `path` (and `headers`, \
             `not_found`); it goes to the forward request's own host"
        ));
    }
    let path = match m.remove("path") {
        Some(serde_json::Value::String(p)) if p.starts_with('/') => p,
        _ => return Err("`lookup_args` gave no `path` starting with `/`".into()),
    };
    if path
        .chars()
        .any(|c| c.is_control() || c.is_whitespace() || c == '#')
    {
        return Err(format!(
            "`lookup_args` gave the path {path:?}, not a request path"
        ));
    }
    let text = |name: &str| forward.get(name).and_then(serde_json::Value::as_str);
    let (Some(scheme @ ("http" | "https")), Some(host), Some(port)) = (
        text("scheme"),
        text("host"),
        forward.get("port").and_then(serde_json::Value::as_u64),
    ) else {
        return Err("the forward call is not an HTTP request with a scheme, host and port".into());
    };
    if host.is_empty() || host.contains(['/', '@', '?', '#', '[', ']']) {
        return Err(format!("the forward call's host {host:?} is not a host"));
    }
    let authority = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    m.insert(
        "url".into(),
        serde_json::json!(format!("{scheme}://{authority}{path}")),
    );
    m.insert("host".into(), serde_json::json!(host));
    Ok(mapped)
}

/// Evaluates a recorded `compensate_args` text (as the saga does, long after the admission).
pub fn compensation_args(
    source: &str,
    tool: &str,
    args: &serde_json::Value,
    result: Option<&str>,
) -> Result<serde_json::Value, String> {
    let env = crate::cel_env();
    Mapping::compile(&env, source)?.eval(&env, tool, args, result)
}

/// Converts a CEL value back to JSON: only what JSON has (no bytes, durations or functions).
fn cel_to_json(value: &Value, depth: usize) -> Result<serde_json::Value, String> {
    use serde_json::Value as J;
    if depth > crate::ARGS_DEPTH_MAX {
        return Err("`compensate_args` nests too deep".into());
    }
    Ok(match value {
        Value::Null => J::Null,
        Value::Bool(b) => J::Bool(*b),
        Value::Int(i) => J::from(*i),
        Value::UInt(u) => J::from(*u),
        Value::Float(f) => serde_json::Number::from_f64(*f)
            .map(J::Number)
            .ok_or_else(|| format!("`compensate_args` gave the number {f}, which JSON lacks"))?,
        Value::String(s) => J::String(s.to_string()),
        Value::List(items) => J::Array(
            items
                .iter()
                .map(|v| cel_to_json(v, depth + 1))
                .collect::<Result<_, _>>()?,
        ),
        Value::Map(m) => {
            let mut out = serde_json::Map::new();
            for (k, v) in m.map.iter() {
                let cel::objects::Key::String(k) = k else {
                    return Err(format!(
                        "`compensate_args` has the key {k:?}; argument names are strings"
                    ));
                };
                out.insert(k.to_string(), cel_to_json(v, depth + 1)?);
            }
            J::Object(out)
        }
        other => {
            return Err(format!(
                "`compensate_args` gave a {}, which JSON lacks",
                other.type_of()
            ));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn builds_the_undo_from_the_arguments_and_the_result() {
        let got = compensation_args(
            r#"{"charge": result.id, "amount": args.amount, "why": "cancelled"}"#,
            "refund",
            &json!({"amount": 250, "to": "a@b"}),
            Some(r#"{"id": "ch_1"}"#),
        );
        assert_eq!(
            got,
            Ok(json!({"charge": "ch_1", "amount": 250, "why": "cancelled"}))
        );
    }

    #[test]
    fn a_result_that_is_not_json_is_its_text_and_none_is_null() {
        let src = r#"{"r": result}"#;
        let args = json!({});
        assert_eq!(
            compensation_args(src, "t", &args, Some("ok 42")),
            Ok(json!({"r": "ok 42"}))
        );
        assert_eq!(
            compensation_args(src, "t", &args, None),
            Ok(json!({"r": null}))
        );
    }

    #[test]
    fn anything_but_a_map_or_a_missing_field_is_an_error() {
        let args = json!({"amount": 1});
        let err = |src| compensation_args(src, "t", &args, None).unwrap_err();
        assert!(
            err("args.amount").contains("not a map"),
            "{}",
            err("args.amount")
        );
        assert!(err(r#"{"x": args.missing}"#).contains("failed"));
        assert!(err(r#"{1: 2}"#).contains("argument names are strings"));
        assert!(err("").contains("empty"));
        assert!(err("{").contains("does not compile"));
    }
}
