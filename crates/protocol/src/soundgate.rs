//! The SoundGate compatibility wire (SPEC §4.3): the request and reply shapes of the reference
//! gate, so its clients, probes and load generator run against estop unchanged.
//!
//! Acceptance mirrors the reference server: `op` selects the verb; only the fields that verb reads
//! are type-checked (others, and unknown fields, are ignored); `needs_approval` defaults to
//! `false`; `mac` may be absent or `null`; there is no request id and replies carry only
//! `verdict` (and `message` on `error`). Where estop differs, docs/PROTOCOL.md says so and why.

use estop_kernel::ids::{EffectKey, RunId, ToolName};
use hmac::{Hmac, Mac};
use serde::Deserialize;
use serde_json::value::RawValue;
use sha2::Sha256;

/// The reply the reference sends when a `decide` fails the tag check; its own tests look for
/// the word "unauthenticated".
pub const SG_BAD_MAC_MESSAGE: &str = "unauthenticated decision: bad or missing mac";

/// One SoundGate request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SgRequest {
    /// Ask to release an effect. The effect key also serves as the tool name.
    Submit {
        run: RunId,
        key: EffectKey,
        tool: ToolName,
        needs_approval: bool,
    },
    /// Approve or reject a held effect; `mac` is the hex HMAC tag, when sent.
    Decide {
        run: RunId,
        key: EffectKey,
        approved: bool,
        mac: Option<String>,
    },
    Cancel {
        run: RunId,
    },
    Close {
        run: RunId,
    },
    Ping,
}

/// A SoundGate reply: one `verdict`, plus `message` on `error`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum SgReply {
    Release,
    HeldForApproval,
    RefusedCancelled,
    RefusedDuplicate,
    RefusedRejected,
    Ack,
    Pong,
    Error { message: String },
}

impl SgReply {
    /// The reply as one line with `\n`. Field order matches the reference (`verdict` first).
    pub fn to_line(&self) -> Vec<u8> {
        let fixed: &[u8] = match self {
            SgReply::Release => b"{\"verdict\":\"release\"}\n",
            SgReply::HeldForApproval => b"{\"verdict\":\"held_for_approval\"}\n",
            SgReply::RefusedCancelled => b"{\"verdict\":\"refused_cancelled\"}\n",
            SgReply::RefusedDuplicate => b"{\"verdict\":\"refused_duplicate\"}\n",
            SgReply::RefusedRejected => b"{\"verdict\":\"refused_rejected\"}\n",
            SgReply::Ack => b"{\"verdict\":\"ack\"}\n",
            SgReply::Pong => b"{\"verdict\":\"pong\"}\n",
            SgReply::Error { message } => {
                let mut out = b"{\"verdict\":\"error\",\"message\":".to_vec();
                serde_json::to_writer(&mut out, message).expect("a str serializes");
                out.extend_from_slice(b"}\n");
                return out;
            }
        };
        fixed.to_vec()
    }

    /// Decodes a reply line (for probes and tests).
    pub fn parse(line: &[u8]) -> Result<SgReply, serde_json::Error> {
        serde_json::from_slice(line)
    }
}

/// A request the compatibility listener cannot accept; answered with `{"verdict":"error"}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad request: {detail}")]
pub struct SgError {
    detail: String,
}

impl SgError {
    fn new(detail: impl Into<String>) -> SgError {
        SgError {
            detail: detail.into(),
        }
    }

    /// The error reply, worded like the reference's (`bad request: …`).
    pub fn to_reply(&self) -> SgReply {
        SgReply::Error {
            message: self.to_string(),
        }
    }
}

/// Keeps `null` distinct from absent, so each field is typed exactly as the reference types it.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

#[derive(Deserialize)]
struct SgRaw<'a> {
    #[serde(default, borrow, deserialize_with = "present")]
    op: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    run_id: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    effect_key: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    needs_approval: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    approved: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    mac: Option<&'a RawValue>,
}

fn typed<'a, T: Deserialize<'a>>(
    raw: Option<&'a RawValue>,
    name: &str,
) -> Result<Option<T>, SgError> {
    raw.map(|r| {
        serde_json::from_str::<T>(r.get()).map_err(|e| SgError::new(format!("field `{name}`: {e}")))
    })
    .transpose()
}

fn need<'a, T: Deserialize<'a>>(raw: Option<&'a RawValue>, name: &str) -> Result<T, SgError> {
    typed(raw, name)?.ok_or_else(|| SgError::new(format!("missing field `{name}`")))
}

/// Ids that would show as something else on a screen are refused here as on protocol v1.
fn visible(s: &str, name: &str) -> Result<(), SgError> {
    if crate::text::has_hidden(s) {
        return Err(SgError::new(format!(
            "field `{name}`: contains a control, bidi or zero-width character"
        )));
    }
    Ok(())
}

fn run_of(raw: Option<&RawValue>) -> Result<RunId, SgError> {
    let s: String = need(raw, "run_id")?;
    visible(&s, "run_id")?;
    RunId::new(&s).map_err(|e| SgError::new(format!("field `run_id`: {e}")))
}

fn key_of(raw: Option<&RawValue>) -> Result<EffectKey, SgError> {
    let s: String = need(raw, "effect_key")?;
    visible(&s, "effect_key")?;
    EffectKey::new(&s).map_err(|e| SgError::new(format!("field `effect_key`: {e}")))
}

/// Parses one SoundGate request line. `Ok(None)` for a blank line, which the reference skips
/// without replying. Never panics, whatever the bytes.
pub fn parse_soundgate(line: &[u8]) -> Result<Option<SgRequest>, SgError> {
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    // serde would also read a struct from a JSON array (the reference inherits a variant of
    // that quirk); no client sends one, so only objects are requests here.
    if line.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(SgError::new("a request must be a JSON object"));
    }
    let raw: SgRaw<'_> = serde_json::from_slice(line).map_err(|e| SgError::new(e.to_string()))?;
    let op: String = need(raw.op, "op")?;
    let req = match op.as_str() {
        "submit" => {
            let run = run_of(raw.run_id)?;
            let key = key_of(raw.effect_key)?;
            // Same rules (non-empty, ≤ 200 bytes, no control characters) as an effect key.
            let tool = ToolName::new(key.as_str())
                .map_err(|e| SgError::new(format!("field `effect_key`: {e}")))?;
            let needs_approval = typed(raw.needs_approval, "needs_approval")?.unwrap_or(false);
            SgRequest::Submit {
                run,
                key,
                tool,
                needs_approval,
            }
        }
        "decide" => SgRequest::Decide {
            run: run_of(raw.run_id)?,
            key: key_of(raw.effect_key)?,
            approved: need(raw.approved, "approved")?,
            mac: typed::<Option<String>>(raw.mac, "mac")?.flatten(),
        },
        "cancel" => SgRequest::Cancel {
            run: run_of(raw.run_id)?,
        },
        "close" => SgRequest::Close {
            run: run_of(raw.run_id)?,
        },
        "ping" => SgRequest::Ping,
        other => {
            let shown: String = other.chars().take(64).collect();
            return Err(SgError::new(format!(
                "unknown variant `{shown}`, expected one of `submit`, `decide`, `cancel`, `close`, `ping`"
            )));
        }
    };
    Ok(Some(req))
}

/// The message a decision tag signs: `run \n key \n 1|0`. The newlines keep one field from
/// being shifted into another.
pub fn decision_message(run: &str, key: &str, approved: bool) -> String {
    format!("{run}\n{key}\n{}", if approved { '1' } else { '0' })
}

fn decision_mac(secret: &[u8], run: &str, key: &str, approved: bool) -> Hmac<Sha256> {
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC accepts keys of any length");
    mac.update(decision_message(run, key, approved).as_bytes());
    mac
}

/// HMAC-SHA256(secret, `run\nkey\n1|0`).
pub fn decision_tag(secret: &[u8], run: &str, key: &str, approved: bool) -> [u8; 32] {
    decision_mac(secret, run, key, approved)
        .finalize()
        .into_bytes()
        .into()
}

/// The tag as lowercase hex, as the reference's clients send it in `mac`.
pub fn decision_tag_hex(secret: &[u8], run: &str, key: &str, approved: bool) -> String {
    estop_kernel::ids::Digest(decision_tag(secret, run, key, approved)).to_hex()
}

/// Checks a `mac` field in constant time. A tag that is not 64 hex digits is simply wrong.
/// Upper-case hex is accepted (the reference compares text and would refuse it).
pub fn verify_decision_tag(
    secret: &[u8],
    run: &str,
    key: &str,
    approved: bool,
    mac_hex: &str,
) -> bool {
    let Some(tag) = estop_kernel::ids::Digest::from_hex(mac_hex) else {
        return false;
    };
    decision_mac(secret, run, key, approved)
        .verify_slice(&tag.0)
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Option<SgRequest>, SgError> {
        parse_soundgate(s.as_bytes())
    }

    fn run(s: &str) -> RunId {
        RunId::new(s).expect("run")
    }

    fn key(s: &str) -> EffectKey {
        EffectKey::new(s).expect("key")
    }

    #[test]
    fn parses_every_op() {
        assert_eq!(
            parse(r#"{"op":"submit","run_id":"r1","effect_key":"refund","needs_approval":true}"#),
            Ok(Some(SgRequest::Submit {
                run: run("r1"),
                key: key("refund"),
                tool: ToolName::new("refund").expect("tool"),
                needs_approval: true
            }))
        );
        assert_eq!(
            parse(r#"{"run_id":"r1","effect_key":"k","op":"submit"}"#),
            Ok(Some(SgRequest::Submit {
                run: run("r1"),
                key: key("k"),
                tool: ToolName::new("k").expect("tool"),
                needs_approval: false
            }))
        );
        assert_eq!(
            parse(r#"{"op":"decide","run_id":"r1","effect_key":"k","approved":false,"mac":"ab"}"#),
            Ok(Some(SgRequest::Decide {
                run: run("r1"),
                key: key("k"),
                approved: false,
                mac: Some("ab".into())
            }))
        );
        assert_eq!(
            parse(r#"{"op":"decide","run_id":"r1","effect_key":"k","approved":true,"mac":null}"#),
            Ok(Some(SgRequest::Decide {
                run: run("r1"),
                key: key("k"),
                approved: true,
                mac: None
            }))
        );
        assert_eq!(
            parse(r#"{"op":"cancel","run_id":"r1"}"#),
            Ok(Some(SgRequest::Cancel { run: run("r1") }))
        );
        assert_eq!(
            parse(r#"{"op":"close","run_id":"r1"}"#),
            Ok(Some(SgRequest::Close { run: run("r1") }))
        );
        assert_eq!(parse(r#"{"op":"ping"}"#), Ok(Some(SgRequest::Ping)));
    }

    #[test]
    fn ignores_what_the_reference_ignores() {
        // Unknown fields, an `id`, and fields the op does not read (even of the wrong type).
        assert_eq!(
            parse(r#"{"op":"ping","id":7,"x":[1,2]}"#),
            Ok(Some(SgRequest::Ping))
        );
        assert_eq!(
            parse(r#"{"op":"cancel","run_id":"r","approved":"yes","needs_approval":null}"#),
            Ok(Some(SgRequest::Cancel { run: run("r") }))
        );
        assert_eq!(parse("  \r"), Ok(None));
        assert_eq!(parse(""), Ok(None));
    }

    #[test]
    fn refuses_what_the_reference_refuses() {
        for bad in [
            "nope",
            "[]",
            r#"["ping",null,null,null,null,null]"#,
            r#"{"run_id":"r"}"#,
            r#"{"op":"fly"}"#,
            r#"{"op":7}"#,
            r#"{"op":"submit","effect_key":"k"}"#,
            r#"{"op":"submit","run_id":"r","effect_key":"k","needs_approval":null}"#,
            r#"{"op":"submit","run_id":"r","effect_key":"k","needs_approval":"true"}"#,
            r#"{"op":"decide","run_id":"r","effect_key":"k"}"#,
            r#"{"op":"decide","run_id":"r","effect_key":"k","approved":true,"mac":5}"#,
            r#"{"op":"cancel","run_id":5}"#,
            r#"{"op":"ping","op":"ping"}"#,
            r#"{"op":"ping"} trailing"#,
        ] {
            let err = parse(bad).expect_err(bad);
            assert!(err.to_string().starts_with("bad request: "), "{bad}: {err}");
        }
    }

    #[test]
    fn refuses_ids_estop_cannot_hold() {
        // The reference accepts these; estop's run ids and keys are non-empty, bounded and
        // printable (documented difference).
        assert!(parse(r#"{"op":"cancel","run_id":""}"#).is_err());
        assert!(parse(r#"{"op":"submit","run_id":"r","effect_key":"a\nb"}"#).is_err());
    }

    #[test]
    fn replies_render_exactly_and_round_trip() {
        let cases = [
            (SgReply::Release, r#"{"verdict":"release"}"#),
            (
                SgReply::HeldForApproval,
                r#"{"verdict":"held_for_approval"}"#,
            ),
            (
                SgReply::RefusedCancelled,
                r#"{"verdict":"refused_cancelled"}"#,
            ),
            (
                SgReply::RefusedDuplicate,
                r#"{"verdict":"refused_duplicate"}"#,
            ),
            (
                SgReply::RefusedRejected,
                r#"{"verdict":"refused_rejected"}"#,
            ),
            (SgReply::Ack, r#"{"verdict":"ack"}"#),
            (SgReply::Pong, r#"{"verdict":"pong"}"#),
            (
                SgReply::Error {
                    message: "bad \"x\"".into(),
                },
                r#"{"verdict":"error","message":"bad \"x\""}"#,
            ),
        ];
        for (reply, text) in cases {
            let line = reply.to_line();
            assert_eq!(line, format!("{text}\n").into_bytes());
            assert_eq!(SgReply::parse(&line).ok(), Some(reply));
        }
        let err = parse("{").expect_err("bad json");
        assert!(
            matches!(err.to_reply(), SgReply::Error { message } if message.starts_with("bad request: "))
        );
    }

    #[test]
    fn hmac_matches_rfc4231() {
        // RFC 4231 test case 2, through the same HMAC the tag uses.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(b"Jefe").expect("key");
        mac.update(b"what do ya want for nothing?");
        let hex = estop_kernel::ids::Digest(mac.finalize().into_bytes().into()).to_hex();
        assert_eq!(
            hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn decision_tags_verify_only_for_the_exact_decision() {
        let secret = b"correct-horse-battery-staple";
        let good = decision_tag_hex(secret, "pay-run", "refund", true);
        // Computed outside Rust (Python hmac, as the reference's own e2e_auth client does).
        assert_eq!(
            good,
            "2db62f06ef698931252ebadd67a8572fceebfaf5ab09d3000a1b87cb0fa2007e"
        );
        assert_eq!(
            decision_tag_hex(secret, "pay-run", "refund", false),
            "16615dc269560425b06a5dd5fc46e7b45cf87ad4d00f905c7787f9331f57a223"
        );
        assert!(verify_decision_tag(
            secret, "pay-run", "refund", true, &good
        ));
        assert!(verify_decision_tag(
            secret,
            "pay-run",
            "refund",
            true,
            &good.to_uppercase()
        ));
        // Wrong polarity, key, run, secret: all fail.
        assert!(!verify_decision_tag(
            secret, "pay-run", "refund", false, &good
        ));
        assert!(!verify_decision_tag(
            secret, "pay-run", "other", true, &good
        ));
        assert!(!verify_decision_tag(secret, "run2", "refund", true, &good));
        assert!(!verify_decision_tag(
            b"wrong", "pay-run", "refund", true, &good
        ));
        // Bad tags: forged, wrong length, not hex, empty.
        assert!(!verify_decision_tag(
            secret,
            "pay-run",
            "refund",
            true,
            &"00".repeat(32)
        ));
        assert!(!verify_decision_tag(
            secret,
            "pay-run",
            "refund",
            true,
            &good[..62]
        ));
        assert!(!verify_decision_tag(
            secret,
            "pay-run",
            "refund",
            true,
            &format!("{good}00")
        ));
        assert!(!verify_decision_tag(
            secret,
            "pay-run",
            "refund",
            true,
            &"zz".repeat(32)
        ));
        assert!(!verify_decision_tag(secret, "pay-run", "refund", true, ""));
    }

    #[test]
    fn decision_message_is_run_newline_key_newline_bit() {
        assert_eq!(decision_message("r", "k", true), "r\nk\n1");
        assert_eq!(decision_message("r", "k", false), "r\nk\n0");
    }
}
