//! The SoundGate-compatible listener (SPEC §4.3): the reference system's wire protocol mapped
//! onto the native kernel, so its clients, probes and load generator run unchanged. Every place
//! where the answer differs from the reference is listed in docs/PROTOCOL.md.

use crate::conn::{Opened, close, open};
use crate::core::{Answer, CoreMsg, Out, Outbox, ReplyTo};
use crate::durable::After;
use crate::shared::Shared;
use estop_kernel::vocab::PolicyAction;
use estop_kernel::{Admit, Command, Role};
use estop_protocol::server_line as wire;
use estop_protocol::soundgate::{SG_BAD_MAC_MESSAGE, verify_decision_tag};
use estop_protocol::{Id, Line, SgReply, SgRequest, parse_soundgate};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};

pub use crate::core::{
    SOUNDGATE_PRINCIPAL_NAME as PRINCIPAL_NAME, soundgate_principal as principal,
};

/// Whether and how this listener takes `decide` (SPEC §4.3: off unless the operator opts in).
#[derive(Debug, Clone)]
pub enum Decisions {
    /// `decide` is refused: holds are decided on the operator channel only.
    Off,
    /// `decide` needs a valid HMAC-SHA256 tag under this secret.
    Hmac(Arc<Vec<u8>>),
    /// `decide` is accepted unauthenticated, as the reference does (explicit opt-in).
    Open,
}

impl Decisions {
    /// The ready line's `soundgate_decide=` value.
    pub fn as_str(&self) -> &'static str {
        match self {
            Decisions::Off => "off",
            Decisions::Hmac(_) => "hmac",
            Decisions::Open => "open",
        }
    }
}

/// What a refused `decide` says when decisions are off (the reference's clients look for
/// "unauthenticated").
pub const DECISIONS_OFF_MESSAGE: &str = "unauthenticated decision: decisions over the SoundGate listener are off; decide on the operator channel (estop approve), or start estop serve with ESTOP_SOUNDGATE_SECRET (HMAC tags) or --soundgate-unauthenticated-decide";

/// Renders an answer as the reference would: a verdict in its words (`render` translates),
/// an error with its message, and an `ack` for every other successful answer.
pub fn render(_id: &Id, answer: &Answer) -> Vec<u8> {
    let reply = match answer {
        Answer::Verdict(v) => crate::render::soundgate_verdict(v),
        Answer::Pong => SgReply::Pong,
        Answer::Error(_, message) => SgReply::Error {
            message: message.clone(),
        },
        Answer::Ack(_)
        | Answer::Subscribed(_)
        | Answer::Decided(_)
        | Answer::Run(_)
        | Answer::Runs(_)
        | Answer::Pending(_)
        | Answer::Report(_)
        | Answer::Ledger(_)
        | Answer::Hello(_)
        | Answer::TokenCreated(_)
        | Answer::TokenRevoked(_) => SgReply::Ack,
    };
    reply.to_line()
}

/// Serves one compatibility connection.
pub async fn serve<S>(
    stream: S,
    socket: Option<OwnedFd>,
    shared: Arc<Shared>,
    decisions: Decisions,
    slot: tokio::sync::OwnedSemaphorePermit,
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
    let idle = Duration::from_millis(shared.opts.idle_ms_max);
    let requests = async {
        loop {
            // A client that does not read what it asked for stops being read.
            unwritten.paced().await;
            let line = match tokio::time::timeout(idle, reader.next_line()).await {
                Ok(Ok(Some(l))) => l,
                Ok(Ok(None) | Err(_)) => break,
                // No hello on this wire: a connection counts as authenticated for the idle rule.
                Err(_) => match crate::conn::idle_close(&shared.opts, true, false, &permits) {
                    Some(why) => {
                        crate::log::info(&format!("SoundGate connection {conn} closed: {why}"));
                        let _ = out_tx.send(Out::Answer {
                            id: Id::default(),
                            answer: Answer::Error(estop_protocol::ErrorCode::LimitExceeded, why),
                            after: After::default(),
                        });
                        break;
                    }
                    None => continue,
                },
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
                    Ok(Some(req)) => handle(req, &out_tx, &shared, &decisions),
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
    drop(slot);
}

fn handle(req: SgRequest, out: &Outbox, shared: &Shared, decisions: &Decisions) -> Option<Answer> {
    let to = ReplyTo {
        out: out.clone(),
        id: Id::default(),
        charge: None,
    };
    let send = |msg| crate::shared::send(shared, msg);
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
            let mut ruling = match shared
                .policy
                .evaluate(&tool, Some(&args), agent.name.as_str())
            {
                Ok(v) => v,
                Err(e) => {
                    return Some(Answer::Verdict(wire::VerdictReply::Refused {
                        reason: estop_kernel::vocab::RefusalReason::Denied,
                        message: Some(e.to_string()),
                        rule: None,
                        budget: None,
                    }));
                }
            };
            if !ruling.matched {
                // No rule speaks for this effect: the client's flag decides, as in the reference.
                ruling.action = if needs_approval {
                    PolicyAction::Approve
                } else {
                    PolicyAction::Allow
                };
                ruling.quorum = 1;
            } else {
                ruling.strengthen(needs_approval);
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
                limits: shared.policy.run_limits(crate::shared::wall_ms()),
                policy: Box::new(ruling.into()),
                reserve: Default::default(),
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
            match decisions {
                Decisions::Off => {
                    return Some(Answer::Error(
                        estop_protocol::ErrorCode::Unauthenticated,
                        DECISIONS_OFF_MESSAGE.into(),
                    ));
                }
                Decisions::Hmac(secret) => {
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
                Decisions::Open => {}
            }
            send(CoreMsg::SgDecide {
                run,
                key,
                approved,
                to,
            })
        }
        SgRequest::Cancel { run } => send(CoreMsg::SgStop {
            run,
            close: false,
            to,
        }),
        SgRequest::Close { run } => send(CoreMsg::SgStop {
            run,
            close: true,
            to,
        }),
    }
}
