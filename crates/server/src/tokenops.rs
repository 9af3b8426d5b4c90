//! Creating and revoking tokens, for both front doors (protocol v1 and HTTP): the registry
//! file changes and the change is recorded in the ledger with who made it (a `Command::Token`
//! record: name, role, groups, never the secret or its hash).
//!
//! Order: the registry first, then the record. A creation whose record fails is taken back
//! before its secret was ever shown; a revocation whose record fails stays in force (failing
//! safe) and the operator is told the ledger does not have it.

use crate::core::{Answer, CoreMsg, ReplyTo};
use crate::shared::Shared;
use crate::shared::ask;
use crate::tokens::TokenError;
use estop_kernel::{Command, Principal, PrincipalName, Role, TokenAction, TokenChange};
use estop_protocol::server_line as wire;
use estop_protocol::{ErrorCode, Id};
use std::sync::Arc;

fn err(code: ErrorCode, msg: impl Into<String>) -> Answer {
    Answer::Error(code, msg.into())
}

/// Records the bootstrap tokens a (first or `--reset-tokens`) start wrote, as the gate itself
/// (`estop`), so the ledger's account of who holds a token starts at the beginning. Nobody
/// waits for the answer.
pub fn record_bootstrap(shared: &Shared) {
    for (name, role) in [("admin", Role::Operator), ("agent", Role::Agent)] {
        let (tx, _) = tokio::sync::mpsc::unbounded_channel();
        let change = TokenChange {
            action: TokenAction::Create,
            name: PrincipalName::new(name).expect("a valid name"),
            role,
            groups: Vec::new(),
        };
        let _ = shared.core_tx.send(CoreMsg::Apply {
            principal: crate::core::system_principal(),
            cmd: Command::Token(change),
            to: ReplyTo {
                out: tx.into(),
                id: Id::default(),
                charge: None,
            },
        });
    }
}

/// The answer for a registry error.
pub fn token_error(e: &TokenError) -> Answer {
    let code = match e {
        TokenError::Exists(_) | TokenError::LastOperator(_) => ErrorCode::Conflict,
        TokenError::NotFound(_) => ErrorCode::NotFound,
        TokenError::Reserved(_) | TokenError::Invalid(_) => ErrorCode::InvalidField,
        TokenError::Full | TokenError::GrantsFull => ErrorCode::LimitExceeded,
        TokenError::Io { .. }
        | TokenError::Corrupt { .. }
        | TokenError::Missing { .. }
        | TokenError::Store(_)
        | TokenError::MissingInDatabase { .. } => ErrorCode::Unavailable,
    };
    err(code, e.to_string())
}

/// Records a token change in the ledger as `actor`; `Err` is why it could not be.
async fn record(shared: &Shared, actor: &Principal, change: TokenChange) -> Result<(), String> {
    let answer = ask(shared, |to| CoreMsg::Apply {
        principal: actor.clone(),
        cmd: Command::Token(change),
        to,
    })
    .await;
    match answer {
        Answer::Error(code, msg) => Err(format!("{}: {msg}", code.as_str())),
        _ => Ok(()),
    }
}

/// `token {name, role, groups}`: creates the token, records it, returns its secret (once).
pub async fn create(
    shared: &Arc<Shared>,
    actor: &Principal,
    name: PrincipalName,
    role: Role,
    groups: Vec<String>,
) -> Answer {
    let tokens = Arc::clone(&shared.tokens);
    let (n, g) = (name.clone(), groups.clone());
    let made = tokio::task::spawn_blocking(move || tokens.create(n.as_str(), role, &g)).await;
    let secret = match made {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return token_error(&e),
        Err(e) => return err(ErrorCode::Internal, e.to_string()),
    };
    let change = TokenChange {
        action: TokenAction::Create,
        name: name.clone(),
        role,
        groups: groups.iter().map(|g| g.as_str().into()).collect(),
    };
    if let Err(why) = record(shared, actor, change).await {
        let tokens = Arc::clone(&shared.tokens);
        let n = name.clone();
        let undone = tokio::task::spawn_blocking(move || tokens.forget(n.as_str())).await;
        if !matches!(undone, Ok(Ok(_))) {
            crate::log::error(&format!(
                "token {name} was created but neither recorded ({why}) nor taken back: revoke it"
            ));
        }
        return err(
            ErrorCode::Unavailable,
            format!("token {name} was not created: the ledger could not record it ({why})"),
        );
    }
    crate::log::info(&format!(
        "token created: {name} ({}) by {}",
        role.as_str(),
        actor.name
    ));
    Answer::TokenCreated(wire::TokenCreated {
        name: name.to_string(),
        role: role.as_str().into(),
        token: estop_protocol::Secret::new(secret),
        groups,
    })
}

/// `token_revoke {name}`: revokes the token at once, then records who did it.
pub async fn revoke(shared: &Arc<Shared>, actor: &Principal, name: PrincipalName) -> Answer {
    let tokens = Arc::clone(&shared.tokens);
    let n = name.clone();
    let gone = match tokio::task::spawn_blocking(move || tokens.revoke(n.as_str())).await {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => return token_error(&e),
        Err(e) => return err(ErrorCode::Internal, e.to_string()),
    };
    crate::log::info(&format!(
        "token revoked: {name} ({}) by {}",
        gone.role.as_str(),
        actor.name
    ));
    let change = TokenChange {
        action: TokenAction::Revoke,
        name: gone.name.clone(),
        role: gone.role,
        groups: gone.groups.clone(),
    };
    if let Err(why) = record(shared, actor, change).await {
        crate::log::error(&format!(
            "token {name} is revoked, but the ledger could not record it: {why}"
        ));
        return err(
            ErrorCode::Unavailable,
            format!(
                "token {name} is revoked, but the ledger could not record it ({why}); the daemon's log has the revocation"
            ),
        );
    }
    Answer::TokenRevoked(wire::TokenRevoked {
        name: gone.name.to_string(),
        role: gone.role.as_str().into(),
        groups: gone.groups.iter().map(|g| g.to_string()).collect(),
    })
}
