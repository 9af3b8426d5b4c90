//! The runner's control socket: how `estop agent interrupt|budget|status` in another terminal,
//! and the daemon's console (`ask_within`, with a grant for the acting operator), reach a
//! running `estop agent run`. Cancel, pause, resume and kill need no socket: they are
//! the gate's verbs on the trajectory's run, and the runner's subscription turns them into
//! control requests. An interrupt (a new user message) and a budget change are not the gate's
//! business, so they come here.
//!
//! Who can reach it: the socket is `JOURNAL/control.sock`, bound inside a fresh 0700 directory,
//! made 0600 and only then renamed into place, so no other user can ever connect. Within the
//! owner's uid, every request carries a token the daemon authenticates (`hello`): an interrupt
//! or a budget change needs an operator token, as the gate's pause and resume do; the status
//! may be read by any token the daemon knows. One JSON line in, one JSON line out; a request
//! is answered once the control request is stored in the record and the record is durable.

use crate::budget::Limits;
use crate::gate::GateConfig;
use crate::record::Control;
use crate::runner::Input;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, oneshot};

/// The socket's name in the journal directory.
pub const SOCKET: &str = "control.sock";
/// Longest request line (an interrupt's message included).
pub const LINE_BYTES_MAX: usize = 64 * 1024;
/// How long a connection may take to send its request.
const READ_MS_MAX: u64 = 10_000;
/// Connections served at once; more are refused.
const CONNECTIONS_MAX: usize = 64;

/// What another terminal asks of a trajectory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "ask", rename_all = "snake_case")]
pub enum Ask {
    /// The record: state, budget vector and spend, pending work, stored control requests.
    Status,
    /// A new user message, applied at the next turn boundary (an open stream is cut).
    Interrupt { message: String },
    /// New ceilings for the dimensions given; the others stay as they are.
    Budget { change: Limits },
}

/// One request line.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Request {
    pub token: String,
    pub trajectory: String,
    #[serde(flatten)]
    pub ask: Ask,
}

/// One reply line: `{"ok": …}` or `{"error": {"code", "message"}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reply {
    Ok(Value),
    Error(Refusal),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct Refusal {
    /// `bad_request`, `unauthenticated`, `forbidden`, `unknown_trajectory`, `ended`, `busy`.
    pub code: String,
    pub message: String,
}

pub fn refusal(code: &str, message: impl Into<String>) -> Refusal {
    Refusal {
        code: code.into(),
        message: message.into(),
    }
}

/// What the runner is handed: an authenticated ask and where its answer goes.
#[derive(Debug)]
pub struct Asked {
    pub trajectory: String,
    pub ask: Ask,
    pub reply: oneshot::Sender<Result<Value, Refusal>>,
}

impl Ask {
    /// Whether only an operator may ask it (changing what a trajectory does or may spend).
    fn operator_only(&self) -> bool {
        !matches!(self, Ask::Status)
    }

    /// Bad input is refused here, before it reaches the runner.
    fn check(&self) -> Result<(), Refusal> {
        match self {
            Ask::Interrupt { message } if message.trim().is_empty() => Err(refusal(
                "bad_request",
                "an interrupt needs a non-empty message",
            )),
            Ask::Budget { change } if *change == Limits::default() => Err(refusal(
                "bad_request",
                "a budget change needs at least one of turns, tokens, wall_ms, usd",
            )),
            _ => Ok(()),
        }
    }
}

/// The control request a budget change becomes: the ceilings in force once the requests
/// already stored are applied, with the given dimensions replaced.
pub fn budget_control(current: Limits, stored: &[Control], change: Limits) -> Control {
    let base = stored
        .iter()
        .rev()
        .find_map(|c| match c {
            Control::Budget { limits } => Some(*limits),
            _ => None,
        })
        .unwrap_or(current);
    Control::Budget {
        limits: Limits {
            turns_max: change.turns_max.or(base.turns_max),
            tokens_max: change.tokens_max.or(base.tokens_max),
            wall_ms_max: change.wall_ms_max.or(base.wall_ms_max),
            usd_micros_max: change.usd_micros_max.or(base.usd_micros_max),
        },
    }
}

/// Binds `dir/control.sock` privately (see the module's comment). A socket left by a runner
/// that died is replaced: the caller holds the journal's lock, so no live runner owns it.
pub fn bind(dir: &Path) -> std::io::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    // Staged under a path no longer than the final one (a socket path has at most 107 bytes).
    let private = dir.join(format!(".c{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&private);
    std::fs::DirBuilder::new().mode(0o700).create(&private)?;
    let staged = private.join("s");
    let bound = (|| {
        let l = tokio::net::UnixListener::bind(&staged)?;
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o600))?;
        std::fs::rename(&staged, dir.join(SOCKET))?;
        Ok(l)
    })();
    let _ = std::fs::remove_dir_all(&private);
    bound
}

/// Serves the socket until the runner goes away: each request authenticated at the gate,
/// checked, and handed to the runner as [`Input::Ask`].
pub async fn serve(
    listener: tokio::net::UnixListener,
    gate: GateConfig,
    tx: mpsc::UnboundedSender<Input>,
) {
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(CONNECTIONS_MAX));
    while let Ok((stream, _)) = listener.accept().await {
        if tx.is_closed() {
            return;
        }
        let (gate, tx, slots) = (gate.clone(), tx.clone(), slots.clone());
        tokio::spawn(async move {
            let (r, mut w) = stream.into_split();
            let reply = match slots.try_acquire() {
                Ok(_slot) => match read_request(r).await {
                    Ok(req) => answer(&gate, &tx, req).await,
                    Err(e) => Reply::Error(e),
                },
                Err(_) => Reply::Error(refusal("busy", "too many control connections")),
            };
            let mut line = serde_json::to_vec(&reply).expect("a reply serializes");
            line.push(b'\n');
            let _ = w.write_all(&line).await;
        });
    }
}

async fn read_request(r: tokio::net::unix::OwnedReadHalf) -> Result<Request, Refusal> {
    use tokio::io::AsyncReadExt;
    let mut line = Vec::new();
    let mut reader = BufReader::new(r).take(LINE_BYTES_MAX as u64 + 1);
    let read = tokio::time::timeout(
        Duration::from_millis(READ_MS_MAX),
        reader.read_until(b'\n', &mut line),
    )
    .await;
    match read {
        Err(_) => return Err(refusal("bad_request", "no request line in time")),
        Ok(Err(e)) => return Err(refusal("bad_request", e.to_string())),
        Ok(Ok(_)) if line.len() > LINE_BYTES_MAX => {
            return Err(refusal(
                "bad_request",
                format!("the request is longer than {LINE_BYTES_MAX} bytes"),
            ));
        }
        Ok(Ok(_)) => {}
    }
    serde_json::from_slice(&line).map_err(|e| refusal("bad_request", e.to_string()))
}

async fn answer(gate: &GateConfig, tx: &mpsc::UnboundedSender<Input>, req: Request) -> Reply {
    let run = async {
        req.ask.check()?;
        let role = authenticate(gate, &req.token).await?;
        if req.ask.operator_only() && role != "operator" {
            return Err(refusal(
                "forbidden",
                format!(
                    "an interrupt or a budget change needs an operator token; this is an {role} token"
                ),
            ));
        }
        let (reply, answer) = oneshot::channel();
        let asked = Asked {
            trajectory: req.trajectory,
            ask: req.ask,
            reply,
        };
        tx.send(Input::Ask(asked))
            .map_err(|_| refusal("ended", "the runner is stopping"))?;
        answer
            .await
            .map_err(|_| refusal("ended", "the runner is stopping"))?
    };
    match run.await {
        Ok(v) => Reply::Ok(v),
        Err(e) => Reply::Error(e),
    }
}

/// The token's role, as the daemon says (`hello`); a token it refuses is refused here.
async fn authenticate(gate: &GateConfig, token: &str) -> Result<String, Refusal> {
    let (target, token) = (gate.target.clone(), token.to_string());
    tokio::task::spawn_blocking(move || {
        let mut c = estop_server::client::Client::connect(&target)
            .map_err(|e| refusal("unauthenticated", format!("the gate cannot be asked: {e}")))?;
        c.hello(&token)
            .map(|h| h.role)
            .map_err(|e| refusal("unauthenticated", e.to_string()))
    })
    .await
    .unwrap_or_else(|e| Err(refusal("unauthenticated", e.to_string())))
}

/// Sends one request to the runner whose journal is `dir` and returns its answer.
pub fn ask(dir: &Path, req: &Request) -> Result<Value, AskError> {
    use std::io::{BufRead, Write};
    let path: PathBuf = dir.join(SOCKET);
    let mut s = std::os::unix::net::UnixStream::connect(&path).map_err(|e| AskError::NoRunner {
        path: path.display().to_string(),
        source: e,
    })?;
    let mut line = serde_json::to_vec(req).expect("a request serializes");
    line.push(b'\n');
    s.write_all(&line)?;
    let mut back = String::new();
    std::io::BufReader::new(s).read_line(&mut back)?;
    match serde_json::from_str::<Reply>(&back) {
        Ok(Reply::Ok(v)) => Ok(v),
        Ok(Reply::Error(r)) => Err(AskError::Refused(r)),
        Err(e) => Err(AskError::Io(std::io::Error::other(format!(
            "an answer that is not one: {e}"
        )))),
    }
}

/// [`ask`] for a caller on an async thread (the daemon's console): connecting, sending and
/// the answer all within `within`, the answer line bounded by `LINE_BYTES_MAX`.
pub async fn ask_within(dir: &Path, req: &Request, within: Duration) -> Result<Value, AskError> {
    use tokio::io::AsyncReadExt;
    let path = dir.join(SOCKET);
    let exchange = async {
        let s = tokio::net::UnixStream::connect(&path)
            .await
            .map_err(|e| AskError::NoRunner {
                path: path.display().to_string(),
                source: e,
            })?;
        // The request carries a token (or the console's grant) that authenticates as an
        // operator: only a runner of this process's own user is sent it, never whoever else
        // managed to listen at the path.
        let uid = s.peer_cred()?.uid();
        let me = rustix::process::geteuid().as_raw();
        if uid != me {
            return Err(AskError::Foreign {
                path: path.display().to_string(),
                uid,
            });
        }
        let (r, mut w) = s.into_split();
        let mut line = serde_json::to_vec(req).expect("a request serializes");
        line.push(b'\n');
        w.write_all(&line).await?;
        let mut back = Vec::new();
        BufReader::new(r)
            .take(LINE_BYTES_MAX as u64)
            .read_until(b'\n', &mut back)
            .await?;
        Ok::<_, AskError>(back)
    };
    let back = tokio::time::timeout(within, exchange)
        .await
        .map_err(|_| AskError::Timeout(within.as_millis() as u64))??;
    match serde_json::from_slice::<Reply>(&back) {
        Ok(Reply::Ok(v)) => Ok(v),
        Ok(Reply::Error(r)) => Err(AskError::Refused(r)),
        Err(e) => Err(AskError::Io(std::io::Error::other(format!(
            "an answer that is not one: {e}"
        )))),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AskError {
    #[error("the runner did not answer within {0} ms")]
    Timeout(u64),
    #[error(
        "no runner is listening on {path} ({source}); is `estop agent run` running with this journal?"
    )]
    NoRunner {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "{path} is listened on by uid {uid}, not by this user: nothing was sent (a runner's control socket is its own user's)"
    )]
    Foreign { path: String, uid: u32 },
    #[error(transparent)]
    Refused(Refusal),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixStream;

    const STATUS: &[u8] = b"{\"token\": \"t\", \"trajectory\": \"x\", \"ask\": \"status\"}\n";

    async fn ask_raw(path: &Path, line: &[u8]) -> Value {
        let mut s = UnixStream::connect(path).await.unwrap();
        s.write_all(line).await.unwrap();
        let mut out = String::new();
        BufReader::new(s).read_line(&mut out).await.unwrap();
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out:?}"))
    }

    /// What a process of the owner's uid (a command tool, say) can do to the socket: a token
    /// the gate does not take is refused, a line past its bound is refused unread, and holding
    /// every connection slot gets the next one `busy` — room comes back once they close, and
    /// none of it reaches the runner.
    #[test]
    fn hostile_requests_are_refused_and_the_connections_are_bounded() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        rt.block_on(async {
            let listener = bind(dir.path()).unwrap();
            let (tx, mut rx) = mpsc::unbounded_channel();
            let gate = GateConfig {
                target: dir.path().join("no-daemon.sock").display().to_string(),
                token: String::new(),
            };
            tokio::spawn(serve(listener, gate, tx));
            let sock = dir.path().join(SOCKET);

            let v = ask_raw(&sock, STATUS).await;
            assert_eq!(v["error"]["code"], "unauthenticated", "{v}");
            let mut long = vec![b' '; LINE_BYTES_MAX + 10];
            long.push(b'\n');
            let v = ask_raw(&sock, &long).await;
            assert_eq!(v["error"]["code"], "bad_request", "{v}");
            assert!(
                v["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("longer than")
            );

            let mut idle = Vec::new();
            for _ in 0..CONNECTIONS_MAX {
                idle.push(UnixStream::connect(&sock).await.unwrap());
            }
            let v = ask_raw(&sock, STATUS).await;
            assert_eq!(v["error"]["code"], "busy", "{v}");
            drop(idle);
            // Each closed connection's slot is given back once its task reads the end.
            let mut v = ask_raw(&sock, STATUS).await;
            for _ in 0..200 {
                if v["error"]["code"] != "busy" {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
                v = ask_raw(&sock, STATUS).await;
            }
            assert_eq!(v["error"]["code"], "unauthenticated", "room came back: {v}");
            assert!(rx.try_recv().is_err(), "nothing reached the runner");
        });
    }
}

#[cfg(test)]
mod foreign {
    use super::*;

    /// A socket at the control socket's path that another user listens on (someone who could
    /// write the directory) is never sent a request — the request carries a token or a grant
    /// that authenticates as an operator. Needs root to listen as another uid; skipped (said on
    /// stderr) otherwise.
    #[test]
    fn a_control_socket_of_another_user_is_sent_nothing() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: listening as another user needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o777),
        )
        .unwrap();
        let got = dir.path().join("got");
        // A listener as `nobody`: it writes whatever it is sent to `got`.
        let script = format!(
            "import os, socket\nos.setgid(65534)\nos.setuid(65534)\ns = socket.socket(socket.AF_UNIX)\ns.bind({:?})\ns.listen()\nprint('ready', flush=True)\nc, _ = s.accept()\nc.settimeout(2)\ndata = b''\ntry:\n    data = c.recv(65536)\nexcept Exception:\n    pass\nopen({:?}, 'wb').write(data)\nc.sendall(b'{{\"ok\": {{\"stored\": true}}}}\\n')\n",
            dir.path().join(SOCKET).display().to_string(),
            got.display().to_string(),
        );
        let mut child = std::process::Command::new("python3")
            .args(["-c", &script])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut ready = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut ready,
        )
        .unwrap();
        assert_eq!(ready, "ready\n");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let req: Request = serde_json::from_value(serde_json::json!({
            "token": "estop_op_secret", "trajectory": "t", "ask": "interrupt", "message": "m"
        }))
        .unwrap();
        let r = rt.block_on(ask_within(dir.path(), &req, Duration::from_secs(5)));
        assert!(
            matches!(r, Err(AskError::Foreign { uid: 65534, .. })),
            "{r:?}"
        );
        let _ = child.wait();
        let sent = std::fs::read(&got).unwrap_or_default();
        assert!(
            !String::from_utf8_lossy(&sent).contains("estop_op_secret"),
            "the token went to another user's socket: {:?}",
            String::from_utf8_lossy(&sent)
        );
    }
}
