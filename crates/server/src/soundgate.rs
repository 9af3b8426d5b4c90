//! The SoundGate-compatible listener (SPEC §4.3): the reference system's wire protocol mapped
//! onto the native kernel, so its clients, probes and load generator run unchanged. Every place
//! where the answer differs from the reference is listed in docs/PROTOCOL.md.

use crate::conn::{Opened, Shared, close, open};
use crate::core::{Answer, CoreMsg, Out, Outbox, ReplyTo};
use crate::durable::After;
use estop_kernel::vocab::PolicyAction;
use estop_kernel::{Admit, Command, Principal, PrincipalName, Role};
use estop_protocol::reply as wire;
use estop_protocol::soundgate::{SG_BAD_MAC_MESSAGE, verify_decision_tag};
use estop_protocol::{Id, Line, SgReply, SgRequest, parse_soundgate};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite};

/// The principal every compatibility client acts as (one shared identity, as in the reference).
pub fn principal(role: Role) -> Principal {
    Principal {
        name: PrincipalName::new("soundgate").expect("valid"),
        role,
        groups: Vec::new(),
    }
}

/// Renders an answer as the reference would.
pub fn render(_id: &Id, answer: &Answer) -> Vec<u8> {
    let reply = match answer {
        Answer::Verdict(v) => match v {
            wire::Verdict::Admitted { .. } | wire::Verdict::Go => SgReply::Release,
            wire::Verdict::Held { .. } => SgReply::HeldForApproval,
            wire::Verdict::Duplicate { .. } => SgReply::RefusedDuplicate,
            wire::Verdict::Refused { reason, .. } => match reason.as_str() {
                "cancelled" | "closed" | "deadline" | "budget" => SgReply::RefusedCancelled,
                "mismatch" => SgReply::RefusedDuplicate,
                _ => SgReply::RefusedRejected,
            },
        },
        Answer::Pong => SgReply::Pong,
        Answer::Error(_, message) => SgReply::Error {
            message: message.clone(),
        },
        _ => SgReply::Ack,
    };
    reply.to_line()
}

/// Serves one compatibility connection.
pub async fn serve<S>(
    stream: S,
    socket: Option<OwnedFd>,
    shared: Arc<Shared>,
    secret: Option<Arc<Vec<u8>>>,
) where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let Opened {
        conn,
        mut reader,
        out_tx,
        permits,
        unwritten,
        writer,
        ..
    } = open(stream, socket, &shared, render);
    let requests = async {
        loop {
            // A client that does not read what it asked for stops being read.
            unwritten.paced().await;
            let line = match reader.next_line().await {
                Ok(Some(l)) => l,
                Ok(None) | Err(_) => break,
            };
            match permits.acquire().await {
                Ok(p) => p.forget(),
                Err(_) => break,
            }
            let answer = match line {
                Line::TooLong { bytes } => Some(Answer::Error(
                    estop_protocol::ErrorCode::LineTooLong,
                    format!("bad request: line of {bytes} bytes is too long"),
                )),
                Line::Text(bytes) => match parse_soundgate(bytes) {
                    Ok(None) => {
                        permits.add_permits(1);
                        continue;
                    }
                    Err(e) => Some(Answer::Error(
                        estop_protocol::ErrorCode::BadJson,
                        e.to_string(),
                    )),
                    Ok(Some(req)) => {
                        handle(req, &out_tx, &shared, secret.as_deref().map(Vec::as_slice))
                    }
                },
            };
            if let Some(answer) = answer {
                let _ = out_tx.send(Out::Answer {
                    id: Id::default(),
                    answer,
                    after: After::default(),
                });
            }
        }
    };
    // A connection that falls too far behind its replies is closed whatever its reader does.
    tokio::select! {
        () = requests => {}
        () = unwritten.crossed() => {}
    }
    close(&shared, conn, out_tx, writer).await;
}

fn handle(req: SgRequest, out: &Outbox, shared: &Shared, secret: Option<&[u8]>) -> Option<Answer> {
    let to = ReplyTo {
        out: out.clone(),
        id: Id::default(),
        charge: None,
    };
    let send = |msg| match shared.core_tx.send(msg) {
        Ok(()) => None,
        Err(_) => Some(Answer::Error(
            estop_protocol::ErrorCode::Unavailable,
            "the gate is shutting down".into(),
        )),
    };
    let agent = principal(Role::Agent);
    match req {
        SgRequest::Ping => Some(Answer::Pong),
        SgRequest::Submit {
            run,
            key,
            tool,
            needs_approval,
        } => {
            let args = serde_json::json!({});
            let mut verdict = match shared
                .policy
                .evaluate(&tool, Some(&args), agent.name.as_str())
            {
                Ok(v) => v,
                Err(e) => {
                    return Some(Answer::Verdict(wire::Verdict::Refused {
                        reason: "denied".into(),
                        message: Some(e.to_string()),
                        rule: None,
                    }));
                }
            };
            if !verdict.matched {
                // No rule speaks for this effect: the client's flag decides, as in the reference.
                verdict.action = if needs_approval {
                    PolicyAction::Approve
                } else {
                    PolicyAction::Allow
                };
                verdict.quorum = 1;
            } else {
                verdict.strengthen(needs_approval);
            }
            let digest = estop_protocol::digest_of(&tool, &args);
            let cmd = Command::Admit(Admit {
                run,
                key,
                tool,
                digest,
                args: None,
                start: true,
                parent: None,
                labels: Vec::new(),
                limits: shared.policy.run_limits(crate::conn::wall_ms()),
                policy: verdict.into(),
            });
            send(CoreMsg::Apply {
                principal: agent,
                cmd,
                to,
            })
        }
        SgRequest::Decide {
            run,
            key,
            approved,
            mac,
        } => {
            if let Some(secret) = secret {
                let ok = mac.as_deref().is_some_and(|m| {
                    verify_decision_tag(secret, run.as_str(), key.as_str(), approved, m)
                });
                if !ok {
                    return Some(Answer::Error(
                        estop_protocol::ErrorCode::Unauthenticated,
                        SG_BAD_MAC_MESSAGE.into(),
                    ));
                }
            }
            send(CoreMsg::SgDecide {
                run,
                key,
                approved,
                to,
            })
        }
        SgRequest::Cancel { run } => send(CoreMsg::SgCancel { run, to }),
        SgRequest::Close { run } => send(CoreMsg::Apply {
            principal: agent,
            cmd: Command::Close { run, failed: false },
            to,
        }),
    }
}
