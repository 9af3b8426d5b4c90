//! Starts a real `estop serve` on a temp data dir, waits for its ready line (never sleeps), and
//! hands out authenticated clients.

#![allow(dead_code)]

pub mod partition;
pub mod pg;

use estop_protocol::{ClientReply, ServerLine, parse_server_line};
use estop_server::client::{Client, ClientError};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

pub const POLICY: &str = r#"
[defaults]
unknown_tool = "approve"
approval_expiry = "10m"

[[rules]]
tool = "search*"
action = "allow"
class = "read"

[[rules]]
tool = "pay"
action = "allow"

[[rules]]
tool = "refund"
action = "approve"

[[rules]]
tool = "wire"
action = "approve"
quorum = 2

[[rules]]
tool = "drop_table"
action = "deny"
"#;

pub struct Daemon {
    pub dir: tempfile::TempDir,
    pub child: Option<Child>,
    pub ready: String,
    pub extra: Vec<String>,
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_estop")
}

impl Daemon {
    pub fn start() -> Daemon {
        Daemon::start_with(&[])
    }

    pub fn start_with(extra: &[&str]) -> Daemon {
        Daemon::start_with_policy(POLICY, extra)
    }

    /// A daemon under `policy` (TOML text).
    pub fn start_with_policy(policy: &str, extra: &[&str]) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("policy.toml"), policy).unwrap();
        let mut extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        if pg::suite_on_postgres() && !extra.iter().any(|a| a == "--store") {
            // The same suite on the other store: this daemon is a node on a fresh database.
            match pg::database() {
                Some(url) => extra.extend(["--store".to_string(), url]),
                None => {
                    eprintln!("ESTOP_TEST_SKIP_POSTGRES=1: this daemon runs on the embedded ledger")
                }
            }
        }
        let mut d = Daemon {
            dir,
            child: None,
            ready: String::new(),
            extra,
        };
        d.spawn();
        d
    }

    pub fn data(&self) -> &Path {
        self.dir.path()
    }

    pub fn socket(&self) -> String {
        self.data().join("estop.sock").display().to_string()
    }

    /// Starts the daemon and blocks until it prints `estop ready`.
    pub fn spawn(&mut self) {
        self.spawn_env(&[]);
    }

    /// `spawn`, with these variables in the daemon's environment.
    pub fn spawn_env(&mut self, env: &[(&str, &str)]) {
        let mut child = Command::new(bin())
            .arg("serve")
            .arg("--data")
            .arg(self.data())
            .arg("--policy")
            .arg(self.data().join("policy.toml"))
            .args(&self.extra)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn estop serve");
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line.starts_with("estop ready") {
                    let _ = tx.send(line);
                }
            }
        });
        let log = self.data().join("serve.log");
        std::thread::spawn(move || {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .unwrap();
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = writeln!(f, "{line}");
            }
        });
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(line) => self.ready = line,
            Err(_) => {
                let _ = child.kill();
                let log =
                    std::fs::read_to_string(self.data().join("serve.log")).unwrap_or_default();
                panic!("estop serve did not become ready; log:\n{log}");
            }
        }
        self.child = Some(child);
    }

    /// The value of `key=` in the ready line.
    pub fn ready_field(&self, key: &str) -> String {
        self.ready
            .split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{key}=")))
            .unwrap_or_default()
            .to_string()
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    /// SIGTERM and wait; returns the exit status code.
    pub fn terminate(&mut self) -> Option<i32> {
        let c = self.child.take()?;
        let pid = c.id() as i32;
        // SAFETY-free: use the kill binary rather than libc.
        Command::new("kill")
            .arg("-TERM")
            .arg(pid.to_string())
            .status()
            .unwrap();
        let out = c.wait_with_output().unwrap();
        out.status.code()
    }

    pub fn token(&self, name: &str) -> String {
        std::fs::read_to_string(self.data().join(name))
            .unwrap()
            .trim()
            .to_string()
    }

    pub fn agent(&self) -> Client {
        Client::connect_as(&self.socket(), &self.token("agent.token")).unwrap()
    }

    pub fn operator(&self) -> Client {
        Client::connect_as(&self.socket(), &self.token("operator.token")).unwrap()
    }

    pub fn client_with(&self, token: &str) -> Client {
        Client::connect_as(&self.socket(), token).unwrap()
    }

    /// Runs the CLI against this daemon; returns (exit code, stdout, stderr).
    pub fn cli(&self, args: &[&str]) -> (i32, String, String) {
        let out = Command::new(bin())
            .args(args)
            .arg("--data")
            .arg(self.data())
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into(),
            String::from_utf8_lossy(&out.stderr).into(),
        )
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The wire as JSON, for tests that pin its shapes or send what no typed request can: a request
/// written as a JSON object, a reply read back as the protocol crate decodes any line (the
/// whole object kept). Typed requests go through `Client::request` instead.
pub trait Wire {
    /// Sends `req` with a fresh `id` and returns its reply; events that come first are kept
    /// in the client's `events`.
    fn call(&mut self, req: Value) -> Result<ClientReply, ClientError>;
    /// Writes `line` as it is, plus a newline.
    fn send_raw(&mut self, line: &[u8]) -> Result<(), ClientError>;
    /// The next line, decoded.
    fn read_line(&mut self) -> Result<ServerLine, ClientError>;
}

impl Wire for Client {
    fn call(&mut self, mut req: Value) -> Result<ClientReply, ClientError> {
        let id = self.raw_next_id();
        req["id"] = json!(id);
        self.raw_send_line(&serde_json::to_vec(&req).unwrap())?;
        loop {
            match self.read_line()? {
                ServerLine::Event(e) => self.events.push(e),
                ServerLine::Reply(r) if r.id.as_u64() == Some(id) || r.id.is_null() => {
                    return Ok(r);
                }
                ServerLine::Reply(_) => continue,
            }
        }
    }

    fn send_raw(&mut self, line: &[u8]) -> Result<(), ClientError> {
        self.raw_send_line(line)
    }

    fn read_line(&mut self) -> Result<ServerLine, ClientError> {
        let line = self.raw_read_line()?;
        parse_server_line(line.as_bytes())
            .map_err(|e| ClientError::Protocol(format!("{e}: {line}")))
    }
}

/// Calls and returns the reply object, asserting `ok`.
pub fn ok(c: &mut Client, req: Value) -> Value {
    let r = c.call(req.clone()).unwrap();
    assert!(r.ok, "request {req} failed: {}", r.raw);
    r.raw
}

/// Calls and returns the error code.
pub fn err_code(c: &mut Client, req: Value) -> String {
    let r = c.call(req.clone()).unwrap();
    assert!(!r.ok, "request {req} unexpectedly succeeded: {}", r.raw);
    r.error.unwrap().code
}

pub fn admit(c: &mut Client, run: &str, key: &str, tool: &str, args: Value) -> Value {
    ok(
        c,
        json!({"op": "admit", "run": run, "key": key, "tool": tool, "args": args}),
    )
}

pub fn verdict(v: &Value) -> &str {
    v["verdict"].as_str().unwrap_or("?")
}

pub fn data_path(d: &Daemon) -> PathBuf {
    d.data().to_path_buf()
}

/// Calls `look` every `every` until it says done (`(true, _)`) or `within` has passed; returns
/// what it last saw, for the caller to assert on. A readiness wait on what the test can see,
/// bounded, never a bare sleep.
#[allow(dead_code)] // not every test binary polls
pub fn poll<T>(within: Duration, every: Duration, mut look: impl FnMut() -> (bool, T)) -> T {
    let until = std::time::Instant::now() + within;
    loop {
        let (done, seen) = look();
        if done || std::time::Instant::now() > until {
            return seen;
        }
        std::thread::sleep(every);
    }
}
