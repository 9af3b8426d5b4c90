//! The effect digest: SHA-256 of the RFC 8785 (JCS) canonical JSON of `{"tool": …, "args": …}`.
//!
//! JCS sorts object keys by UTF-16 code units, writes numbers the way ECMAScript does (`1.0` is
//! `1`, `1e21` is `1e+21`) and escapes strings minimally, so a client in any language that
//! implements RFC 8785 computes the same digest for the same call.

use estop_kernel::ids::{Digest, ToolName};
use serde_json::Value;
use sha2::{Digest as _, Sha256};

/// Appends the RFC 8785 canonical form of `v` to `out`.
///
/// Hand-written for `serde_json::Value` because it is on every admit: the general-purpose
/// canonicalizers re-parse each object key to sort it and cost several times more. The tests
/// check this writer against `serde_json_canonicalizer` on random values.
///
/// Recursion follows the value's depth; values parsed from the wire are at most 128 deep
/// (serde_json's limit).
pub fn write_canonical(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(n) => write_number(out, n),
        // serde_json escapes exactly what JCS escapes: `"`, `\`, and U+0000..U+001F (as \b \f
        // \n \r \t or lowercase \u00xx); everything else, `/` and U+007F included, is literal.
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(out, item);
            }
            out.push(b']');
        }
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            // JCS orders keys by UTF-16 code units. Map iteration is usually already in code
            // point order, which agrees except around surrogates, so this sort is nearly free.
            entries.sort_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
            out.push(b'{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_string(out, k);
                out.push(b':');
                write_canonical(out, v);
            }
            out.push(b'}');
        }
    }
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    serde_json::to_writer(&mut *out, s).expect("writing a str into a Vec cannot fail");
}

/// JSON numbers are IEEE doubles in JCS: integers too are formatted as the double they round
/// to, in ECMAScript's `Number.prototype.toString` form (`1e+21`, `1.5e-7`, `100`).
fn write_number(out: &mut Vec<u8>, n: &serde_json::Number) {
    let f = if let Some(u) = n.as_u64() {
        u as f64
    } else if let Some(i) = n.as_i64() {
        i as f64
    } else {
        // Without arbitrary_precision every other number is an f64, and always finite.
        n.as_f64().unwrap_or(0.0)
    };
    let mut buf = ryu_js::Buffer::new();
    out.extend_from_slice(buf.format_finite(f).as_bytes());
}

/// The canonical bytes [`digest_of`] hashes: `{"args":…,"tool":…}` in JCS form. Also what an
/// operator is shown as "exactly what is being approved".
pub fn canonical_input(tool: &ToolName, args: &Value) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    // "args" < "tool": the envelope's key order is fixed.
    out.extend_from_slice(b"{\"args\":");
    write_canonical(&mut out, args);
    out.extend_from_slice(b",\"tool\":");
    write_string(&mut out, tool.as_str());
    out.push(b'}');
    out
}

/// The digest an effect is bound to: `SHA-256(JCS({"tool": tool, "args": args}))`.
pub fn digest_of(tool: &ToolName, args: &Value) -> Digest {
    Digest(Sha256::digest(canonical_input(tool, args)).into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sha256_hex(bytes: &[u8]) -> String {
        Digest(Sha256::digest(bytes).into()).to_hex()
    }

    fn tool(s: &str) -> ToolName {
        ToolName::new(s).expect("test tool name")
    }

    fn args(json: &str) -> serde_json::Value {
        serde_json::from_str(json).expect("test args")
    }

    #[test]
    fn key_order_and_number_formatting_follow_jcs() {
        // Written by hand from RFC 8785: keys sorted, 1.0 -> 1, 1e21 -> 1e+21, -0 -> 0,
        // 0.5 stays, whitespace gone, "/" and non-ASCII unescaped, U+000F as \u000f.
        let a = args(
            r#"{ "b": 1.0, "a": [1e21, "x/é", null, true, false], "c": {"z": 0.5, "y": -0.0},
                         "d": "\u000f\n", "e": 1e-7, "f": 123456789012345678901234567890 }"#,
        );
        let canonical = concat!(
            r#"{"args":{"a":[1e+21,"x/é",null,true,false],"b":1,"c":{"y":0,"z":0.5},"#,
            r#""d":"\u000f\n","e":1e-7,"f":1.2345678901234568e+29},"tool":"http.post"}"#
        );
        assert_eq!(
            String::from_utf8_lossy(&canonical_input(&tool("http.post"), &a)),
            canonical
        );
        assert_eq!(
            digest_of(&tool("http.post"), &a).to_hex(),
            sha256_hex(canonical.as_bytes())
        );
    }

    #[test]
    fn keys_sort_by_utf16_code_units_not_code_points() {
        // U+FF5E sorts before U+1F600 by code point but after it in UTF-16 (0xD83D < 0xFF5E).
        let a = args(r#"{"～": 1, "😀": 2, "a": 3}"#);
        let canonical = r#"{"args":{"a":3,"😀":2,"～":1},"tool":"t"}"#;
        assert_eq!(
            digest_of(&tool("t"), &a).to_hex(),
            sha256_hex(canonical.as_bytes())
        );
    }

    #[test]
    fn rfc8785_example_canonicalizes() {
        // RFC 8785 §3.2.2 input and output, wrapped in the digest envelope.
        let a = args(
            r#"{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
                "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
                "literals": [null, true, false]}"#,
        );
        let canonical = concat!(
            r#"{"args":{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"#,
            r#""string":"€$\u000f\nA'B\"\\\\\"/"},"tool":"t"}"#
        );
        assert_eq!(
            String::from_utf8_lossy(&canonical_input(&tool("t"), &a)),
            canonical
        );
    }

    fn reference_jcs(tool: &ToolName, args: &serde_json::Value) -> Vec<u8> {
        serde_json_canonicalizer::to_vec(&serde_json::json!({"tool": tool.as_str(), "args": args}))
            .expect("reference JCS")
    }

    fn any_value() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::Value;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            (-30i32..30, any::<u32>()).prop_map(|(e, m)| Value::from(f64::from(m) * 10f64.powi(e))),
            any::<String>().prop_map(Value::from),
            "[a-z\\u{e000}-\\u{e010}\\u{1f600}-\\u{1f610}\\u{0}-\\u{1f}\\u{7f}/\"\\\\]{0,6}"
                .prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 40, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
                prop::collection::btree_map(
                    "[a-zA-Z0-9\\u{e000}-\\u{e010}\\u{1f600}-\\u{1f610}\\u{0}-\\u{1f}é]{0,4}",
                    inner,
                    0..6
                )
                .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        /// The fast writer agrees with the reference canonicalizer on arbitrary values.
        #[test]
        fn canonical_form_matches_the_reference(args in any_value(), name in "[a-z._]{1,12}") {
            let t = tool(&name);
            let ours = String::from_utf8(canonical_input(&t, &args)).expect("utf8");
            let reference = String::from_utf8(reference_jcs(&t, &args)).expect("utf8");
            prop_assert_eq!(ours, reference);
        }
    }

    #[test]
    fn fixed_vector_for_other_clients() {
        // Pinned so the Python and TypeScript clients can assert the same value.
        let a = args(r#"{"amount": 10.0, "to": "acct-1"}"#);
        let canonical = r#"{"args":{"amount":10,"to":"acct-1"},"tool":"refund"}"#;
        assert_eq!(
            digest_of(&tool("refund"), &a).to_hex(),
            sha256_hex(canonical.as_bytes())
        );
        // Computed outside Rust (Python hashlib over the canonical text above).
        assert_eq!(
            digest_of(&tool("refund"), &a).to_hex(),
            "8833f3bd12786d1bfb0512eb3624a0de38e845d906c110a4bab60af53bbd1b96"
        );
    }
}
