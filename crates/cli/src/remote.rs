//! Talking to a running daemon as an operator: the connection flags, typed requests built from
//! the command line through the protocol's own checks, listings read page by page, and refusals
//! mapped to exit codes.

use clap::Args;
use estop_protocol::{
    ErrorCode, Fields, Op, PendingReply, ReplyBody, Report, RequestError, RunsReply, Verb,
};
use estop_server::client::{Client, ClientError};
use serde_json::{Value, json};
use std::path::PathBuf;

#[derive(Args, Clone)]
pub struct Conn {
    /// Data directory of the daemon (its socket and operator token live there).
    #[arg(long, env = "ESTOP_DATA", default_value = "estop-data", global = true)]
    pub data: PathBuf,
    /// Socket path or host:port of the daemon (default: DATA/estop.sock).
    #[arg(long, env = "ESTOP_SOCKET", global = true)]
    pub socket: Option<String>,
    /// Token to authenticate with (default: the contents of DATA/operator.token).
    #[arg(long, env = "ESTOP_TOKEN", global = true, hide_env_values = true)]
    pub token: Option<String>,
    /// Print JSON for scripts instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
}

/// An error with the exit code it maps to.
pub struct Failure {
    pub code: u8,
    pub message: String,
}

impl Failure {
    pub fn new(message: impl Into<String>) -> Failure {
        Failure {
            code: 1,
            message: message.into(),
        }
    }
}

/// A request as named values, the way the command line gives them: built into a typed request
/// by [`Fields`], so a value the gate would refuse is refused here with the gate's own words.
#[derive(Clone)]
pub struct Ask {
    verb: Verb,
    text: Vec<(&'static str, String)>,
    groups: Option<Value>,
    /// JSON fields (`result`).
    json: Vec<(&'static str, Value)>,
}

impl Ask {
    pub fn new(verb: Verb) -> Ask {
        Ask {
            verb,
            text: Vec::new(),
            groups: None,
            json: Vec::new(),
        }
    }

    /// A text field (an id, a reason, a vocabulary word).
    pub fn text(mut self, name: &'static str, value: impl Into<String>) -> Ask {
        self.text.push((name, value.into()));
        self
    }

    /// A text field, when it was given.
    pub fn text_opt(self, name: &'static str, value: Option<String>) -> Ask {
        match value {
            Some(v) => self.text(name, v),
            None => self,
        }
    }

    /// A JSON field, when it was given (a `settle`'s `result`).
    pub fn json_opt(mut self, name: &'static str, value: Option<Value>) -> Ask {
        if let Some(v) = value {
            self.json.push((name, v));
        }
        self
    }

    /// The approver groups of a `token` request.
    pub fn groups(mut self, groups: &[String]) -> Ask {
        self.groups = Some(json!(groups));
        self
    }

    /// The typed request, with `limit` when given.
    fn op(&self, limit: Option<u32>) -> Result<Op, RequestError> {
        let mut f = Fields::new();
        for (name, value) in &self.text {
            f.text(name, value);
        }
        if let Some(groups) = &self.groups {
            f.json("groups", groups);
        }
        for (name, value) in &self.json {
            f.json(name, value);
        }
        if let Some(l) = limit {
            f.number("limit", u64::from(l));
        }
        f.build(self.verb).map(|r| r.op)
    }
}

/// One authenticated connection of one CLI command, and how the command prints.
pub struct Session {
    client: Client,
    json: bool,
    /// The id of the reply `print` shows (a listing's first page).
    reply_id: Option<u64>,
}

impl Session {
    /// Connects to the daemon of `conn` and says hello with its token.
    pub fn open(conn: &Conn) -> Result<Session, Failure> {
        let token = token(conn)?;
        let mut client = Client::connect(&target(conn)).map_err(|e| Failure::new(e.to_string()))?;
        match client.hello(&token) {
            Ok(_) => {}
            Err(e @ (ClientError::Refused { .. } | ClientError::RefusedUnknown { .. })) => {
                return Err(Failure::new(format!(
                    "the gate refused the token ({e}); pass --token or ESTOP_TOKEN, or --data DIR"
                )));
            }
            Err(e) => return Err(Failure::new(e.to_string())),
        }
        Ok(Session {
            client,
            json: conn.json,
            reply_id: None,
        })
    }

    /// Sends one request and returns its reply's payload as `T`; a refusal becomes the
    /// failure its code maps to (printed as JSON too with `--json`).
    pub fn ask<T: TryFrom<ReplyBody, Error = ReplyBody>>(&mut self, op: &Op) -> Result<T, Failure> {
        let body = self.client.ask(op);
        self.reply_id = self.client.last_id();
        body.map_err(|e| self.failure(e))
    }

    /// Reads a listing page by page, following its cursor, into one page whose lists hold
    /// every page's items: all of them, or the first `limit` (then `more` says whether there
    /// were others).
    pub fn listing<P: Page>(&mut self, ask: &Ask, limit: Option<u32>) -> Result<P, Failure> {
        let mut ask = ask.clone();
        let mut all: Option<(P, Option<u64>)> = None;
        let mut count = 0;
        loop {
            let op = ask
                .op(limit.map(|l| l.saturating_sub(count).max(1)))
                .map_err(|e| self.invalid(e))?;
            let mut page: P = self.ask(&op)?;
            count += page.counted() as u32;
            let next = page.take_next();
            match &mut all {
                // The joined page is the first one, under its id, with the others' items.
                None => all = Some((page, self.reply_id)),
                Some((all, _)) => all.append(page),
            }
            let done = limit.is_some_and(|l| count >= l);
            match next {
                Some(next) if !done => {
                    ask.text.retain(|(name, _)| *name != "cursor");
                    ask = ask.text("cursor", next);
                }
                _ => {
                    let (mut all, id) = all.expect("a page was read");
                    if next.is_none() {
                        all.set_more(false);
                    }
                    self.reply_id = id;
                    return Ok(all);
                }
            }
        }
    }

    /// Prints the payload as JSON with `--json` (the reply object with its `id` and `ok`,
    /// keys in name order: what scripts have always read), or else runs `human`.
    pub fn print(&self, body: impl Into<ReplyBody>, human: impl FnOnce()) {
        if self.json {
            let mut v = body.into().to_value();
            if let Some(o) = v.as_object_mut() {
                o.insert("id".into(), json!(self.reply_id));
                o.insert("ok".into(), json!(true));
            }
            println!("{v}");
        } else {
            human();
        }
    }

    /// The failure a refusal maps to: exit 4 for not found, 3 for a refusal of what was asked
    /// (not pending, conflict, forbidden, bad token), 1 otherwise.
    fn failure(&self, e: ClientError) -> Failure {
        let (code, wire_code, message) = match &e {
            ClientError::Refused { code, message } => (exit_code(*code), code.as_str(), message),
            ClientError::RefusedUnknown { code, message } => (1, code.as_str(), message),
            _ => return Failure::new(e.to_string()),
        };
        if self.json {
            let v = json!({
                "id": self.client.last_id(),
                "ok": false,
                "error": {"code": wire_code, "message": message},
            });
            println!("{v}");
        }
        Failure {
            code,
            message: e.to_string(),
        }
    }

    fn invalid(&self, e: RequestError) -> Failure {
        invalid(self.json, e)
    }
}

/// A request the command line cannot make: refused before anything is sent, in the words the
/// gate would use.
pub fn invalid(json: bool, e: RequestError) -> Failure {
    let message = e.kind.to_string();
    if json {
        let v = json!({"ok": false, "error": {"code": e.code().as_str(), "message": message}});
        println!("{v}");
    }
    Failure::new(format!("{}: {message}", e.code()))
}

/// Builds the typed request of `ask` (refused here if the gate would refuse it).
pub fn build(conn: &Conn, ask: &Ask) -> Result<Op, Failure> {
    ask.op(None).map_err(|e| invalid(conn.json, e))
}

fn exit_code(code: ErrorCode) -> u8 {
    match code {
        ErrorCode::NotFound => 4,
        ErrorCode::NotPending
        | ErrorCode::Conflict
        | ErrorCode::Forbidden
        | ErrorCode::BadToken => 3,
        _ => 1,
    }
}

fn target(conn: &Conn) -> String {
    conn.socket
        .clone()
        .unwrap_or_else(|| conn.data.join("estop.sock").display().to_string())
}

pub fn token(conn: &Conn) -> Result<String, Failure> {
    if let Some(t) = &conn.token {
        return Ok(t.clone());
    }
    let path = conn.data.join("operator.token");
    std::fs::read_to_string(&path)
        .map(|t| t.trim().to_string())
        .map_err(|e| {
            Failure::new(format!(
                "cannot read the operator token {}: {e} (pass --data DIR or --token, or set ESTOP_TOKEN)",
                path.display()
            ))
        })
}

/// One page of a listing (`runs`, `pending`, `report`): how its pages join up.
pub trait Page: TryFrom<ReplyBody, Error = ReplyBody> + Into<ReplyBody> {
    /// Items of the list `--limit` counts.
    fn counted(&self) -> usize;
    /// The cursor of the next page, taken out of this one.
    fn take_next(&mut self) -> Option<String>;
    fn set_more(&mut self, more: bool);
    /// Adds a later page's items to this one's lists.
    fn append(&mut self, later: Self);
}

impl Page for RunsReply {
    fn counted(&self) -> usize {
        self.runs.len()
    }
    fn take_next(&mut self) -> Option<String> {
        self.next.take()
    }
    fn set_more(&mut self, more: bool) {
        self.more = more;
    }
    fn append(&mut self, later: Self) {
        self.runs.extend(later.runs);
    }
}

impl Page for PendingReply {
    fn counted(&self) -> usize {
        self.pending.len()
    }
    fn take_next(&mut self) -> Option<String> {
        self.next.take()
    }
    fn set_more(&mut self, more: bool) {
        self.more = more;
    }
    fn append(&mut self, later: Self) {
        self.pending.extend(later.pending);
    }
}

impl Page for Report {
    fn counted(&self) -> usize {
        self.done.len()
    }
    fn take_next(&mut self) -> Option<String> {
        self.next.take()
    }
    fn set_more(&mut self, more: bool) {
        self.more = more;
    }
    fn append(&mut self, later: Self) {
        self.done.extend(later.done);
        self.failed.extend(later.failed);
        self.refused.extend(later.refused);
        self.in_flight.extend(later.in_flight);
        self.unknown.extend(later.unknown);
        self.held.extend(later.held);
        self.compensable.extend(later.compensable);
        self.irreversible.extend(later.irreversible);
        self.undeclared.extend(later.undeclared);
    }
}
