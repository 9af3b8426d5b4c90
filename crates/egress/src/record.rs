//! What the proxy records of an HTTP response as the effect's `result`, so that a compensation
//! can be built from it (`compensate_args` reads `result.*`, docs/POLICY.md): the status, the
//! bytes relayed, a few headers that name what was made (`Location`…) and, when the response is
//! JSON and small, its body. Recorded on the ledger, so it is bounded and never holds a
//! credential the proxy injected: an upstream that echoes one gets that part left out.
//! docs/EGRESS.md, "What an undo needs", is the reference.

use bytes::Bytes;
use hyper::header::HeaderMap;
use serde_json::{Map, Value, json};

/// A JSON body longer than this is not recorded (`body_omitted: "too_large"`): the whole
/// result must fit the ledger's `result_bytes_max` (64 KiB) with the rest beside it.
pub const BODY_BYTES_MAX: usize = 32 * 1024;
/// A recorded header's value longer than this is left out.
pub const HEADER_BYTES_MAX: usize = 2048;
/// The response headers recorded, lower-case: what names the resource a request made.
pub const HEADERS: [&str; 3] = ["location", "content-location", "etag"];

/// Gathers what is recorded while the response is relayed (the relay does not wait for it).
#[derive(Debug)]
pub struct Recorder {
    /// The body so far, while it may still be recorded.
    kept: Option<Vec<u8>>,
    /// Why the body is not recorded, once that is known.
    omitted: Option<&'static str>,
    headers: Map<String, Value>,
}

impl Recorder {
    /// For a response with these headers: its body is kept only if it says it is JSON
    /// (`application/json`, `…+json`) and is not compressed.
    pub fn new(headers: &HeaderMap) -> Recorder {
        let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let media = text("content-type")
            .and_then(|t| t.split(';').next())
            .map(|t| t.trim().to_ascii_lowercase());
        let json = media
            .as_deref()
            .is_some_and(|m| m == "application/json" || m.ends_with("+json"));
        let encoded = text("content-encoding").is_some_and(|e| !e.eq_ignore_ascii_case("identity"));
        let omitted = match (json, encoded) {
            (false, _) => Some("not_json"),
            (true, true) => Some("encoded"),
            (true, false) => None,
        };
        let mut kept = Map::new();
        for name in HEADERS {
            if let Some(v) = text(name).filter(|v| v.len() <= HEADER_BYTES_MAX) {
                kept.insert(name.to_string(), json!(v));
            }
        }
        Recorder {
            kept: omitted.is_none().then(Vec::new),
            omitted,
            headers: kept,
        }
    }

    /// A chunk of the body, as it is relayed.
    pub fn feed(&mut self, data: &Bytes) {
        if let Some(kept) = &mut self.kept {
            if kept.len() + data.len() > BODY_BYTES_MAX {
                self.kept = None;
                self.omitted = Some("too_large");
            } else {
                kept.extend_from_slice(data);
            }
        }
    }

    /// The result of a response relayed whole: `{status, bytes, headers?, body?, body_omitted?}`.
    /// Nothing containing one of `secrets` is recorded (the body is left out whole, a header
    /// alone).
    pub fn finish(self, status: u16, bytes: usize, secrets: &[&str]) -> Value {
        let leaks = |v: &Value| secrets.iter().any(|s| mentions(v, s));
        let mut result = json!({"status": status, "bytes": bytes});
        let headers: Map<String, Value> = self
            .headers
            .into_iter()
            .filter(|(_, v)| !leaks(v))
            .collect();
        if !headers.is_empty() {
            result["headers"] = Value::Object(headers);
        }
        let (body, omitted) = match (self.kept, self.omitted) {
            (Some(kept), _) if kept.is_empty() => (None, None),
            (Some(kept), _) => match serde_json::from_slice::<Value>(&kept) {
                Ok(body) if leaks(&body) => (None, Some("credential")),
                Ok(body) => (Some(body), None),
                Err(_) => (None, Some("not_json")),
            },
            (None, omitted) if bytes > 0 => (None, omitted),
            (None, _) => (None, None),
        };
        if let Some(body) = body {
            result["body"] = body;
        }
        if let Some(why) = omitted {
            result["body_omitted"] = json!(why);
        }
        result
    }
}

/// Whether any string of `v` (a key or a value, at any depth) contains `secret`. Read on the
/// parsed JSON, so an escape (`\/`, `\u0041`) does not hide it.
fn mentions(v: &Value, secret: &str) -> bool {
    match v {
        Value::String(s) => s.contains(secret),
        Value::Array(items) => items.iter().any(|i| mentions(i, secret)),
        Value::Object(m) => m
            .iter()
            .any(|(k, v)| k.contains(secret) || mentions(v, secret)),
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.insert(
                hyper::header::HeaderName::from_bytes(n.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    fn record(h: &[(&str, &str)], chunks: &[&str], secrets: &[&str]) -> Value {
        let mut r = Recorder::new(&headers(h));
        let mut bytes = 0;
        for c in chunks {
            bytes += c.len();
            r.feed(&Bytes::copy_from_slice(c.as_bytes()));
        }
        r.finish(201, bytes, secrets)
    }

    #[test]
    fn a_small_json_body_and_the_location_are_recorded() {
        let got = record(
            &[
                ("content-type", "application/json; charset=utf-8"),
                ("location", "/orders/7"),
                ("set-cookie", "s=1"),
            ],
            &[r#"{"id":"#, r#""o-7"}"#],
            &[],
        );
        assert_eq!(
            got,
            json!({"status": 201, "bytes": 12, "headers": {"location": "/orders/7"},
                "body": {"id": "o-7"}})
        );
        let problem = record(
            &[("content-type", "application/problem+json")],
            &["[1]"],
            &[],
        );
        assert_eq!(problem["body"], json!([1]));
    }

    #[test]
    fn other_bodies_are_left_out_with_the_reason() {
        let text = record(&[("content-type", "text/plain")], &["{}"], &[]);
        assert_eq!(text["body_omitted"], "not_json");
        assert!(text.get("body").is_none());
        let gz = record(
            &[
                ("content-type", "application/json"),
                ("content-encoding", "gzip"),
            ],
            &["{}"],
            &[],
        );
        assert_eq!(gz["body_omitted"], "encoded");
        let bad = record(&[("content-type", "application/json")], &["{nope"], &[]);
        assert_eq!(bad["body_omitted"], "not_json");
        let big = "x".repeat(BODY_BYTES_MAX);
        let large = record(
            &[("content-type", "application/json")],
            &["\"", &big, "\""],
            &[],
        );
        assert_eq!(large["body_omitted"], "too_large");
        assert_eq!(large["bytes"], BODY_BYTES_MAX + 2);
        let empty = record(&[("content-type", "text/plain")], &[], &[]);
        assert_eq!(empty, json!({"status": 201, "bytes": 0}));
    }

    /// An upstream that echoes the credential the proxy injected (even JSON-escaped) gets its
    /// body and that header left out of the record.
    #[test]
    fn nothing_echoing_an_injected_credential_is_recorded() {
        let got = record(
            &[
                ("content-type", "application/json"),
                ("location", "/o/1?k=s3cr3t/x"),
                ("etag", "\"v1\""),
            ],
            &[r#"{"you_sent": {"auth": "Bearer s3cr3t\/x"}}"#],
            &["Bearer s3cr3t/x", "s3cr3t/x"],
        );
        assert_eq!(got["body_omitted"], "credential");
        assert!(got.get("body").is_none());
        assert_eq!(got["headers"], json!({"etag": "\"v1\""}));
        let key = record(
            &[("content-type", "application/json")],
            &[r#"{"s3cr3t/x": 1}"#],
            &["s3cr3t/x"],
        );
        assert_eq!(key["body_omitted"], "credential");
    }
}
