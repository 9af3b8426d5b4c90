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

/// What a write's result records of its request's own body, for an undo that needs it
/// (`compensate_args` reading `result.request_body`): the body parsed when it says it is JSON,
/// else its text when it is UTF-8; as recorded (JSON text) at most `max` bytes. The field and
/// its value: `("request_body", body)`, or `("request_body_omitted", why)` — `too_large`,
/// `not_text`, `encoded`, `credential` (it contains an injected secret) — or nothing for an
/// empty body or `max` 0.
pub fn request_body(
    headers: &HeaderMap,
    body: &[u8],
    max: usize,
    secrets: &[&str],
) -> Option<(&'static str, Value)> {
    if body.is_empty() || max == 0 {
        return None;
    }
    let omitted = |why: &str| Some(("request_body_omitted", json!(why)));
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if text("content-encoding").is_some_and(|e| !e.eq_ignore_ascii_case("identity")) {
        return omitted("encoded");
    }
    if body.len() > max {
        return omitted("too_large");
    }
    let media = text("content-type")
        .and_then(|t| t.split(';').next())
        .map(|t| t.trim().to_ascii_lowercase());
    let json = media
        .as_deref()
        .is_some_and(|m| m == "application/json" || m.ends_with("+json"));
    let value = match (json, std::str::from_utf8(body)) {
        (true, _) if let Ok(v) = serde_json::from_slice::<Value>(body) => v,
        (_, Ok(s)) => json!(s),
        (_, Err(_)) => return omitted("not_text"),
    };
    if secrets.iter().any(|s| mentions(&value, s)) {
        return omitted("credential");
    }
    // Escapes can make the recorded text longer than the body.
    if value.to_string().len() > max {
        return omitted("too_large");
    }
    Some(("request_body", value))
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

    #[test]
    fn a_request_body_is_recorded_parsed_or_as_text_within_its_bound_and_never_a_secret() {
        let json = headers(&[("content-type", "application/json")]);
        let none = HeaderMap::new();
        let body =
            |h: &HeaderMap, b: &str, max: usize| request_body(h, b.as_bytes(), max, &["s3cret"]);
        assert_eq!(
            body(&json, r#"{"amount": 5}"#, 64),
            Some(("request_body", json!({"amount": 5})))
        );
        assert_eq!(
            body(&none, "a=1&b=2", 64),
            Some(("request_body", json!("a=1&b=2")))
        );
        assert_eq!(
            body(&json, "not json", 64),
            Some(("request_body", json!("not json")))
        );
        let too = Some(("request_body_omitted", json!("too_large")));
        assert_eq!(body(&none, &"x".repeat(65), 64), too);
        // Within the bound as bytes, over it as recorded text (each control byte escaped).
        assert_eq!(body(&none, &"\u{1}".repeat(20), 64), too);
        assert_eq!(
            request_body(&none, &[0xff, 0xfe], 64, &[]),
            Some(("request_body_omitted", json!("not_text")))
        );
        assert_eq!(
            body(&json, r#"{"key": "Bearer s3cret"}"#, 64),
            Some(("request_body_omitted", json!("credential")))
        );
        let gz = headers(&[("content-encoding", "gzip")]);
        assert_eq!(
            body(&gz, "x", 64),
            Some(("request_body_omitted", json!("encoded")))
        );
        assert_eq!(body(&json, "", 64), None);
        assert_eq!(body(&json, "{}", 0), None);
    }

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
