//! The daemon's key for sealing admission tokens (`estop_protocol::effect_token`): 32 random
//! bytes made at the first start and kept, so tokens stay valid across restarts. On the embedded
//! store it is `DATA/effect-token.key` (0600, in the 0700 data directory); on a PostgreSQL store
//! it is every node's, a row of `estop_secret`, so a token one node issued opens on another.
//! Losing it costs only the tokens in flight (their `start`/`complete` get `bad_token`).

use estop_protocol::effect_token::TokenSeal;
use std::io;
use std::path::Path;

/// The key file's name in the data directory.
pub const KEY_FILE: &str = "effect-token.key";

/// The seal of the daemon whose data directory is `data` (and whose records are in the database
/// at `store`, when given).
pub fn load(data: &Path, store: Option<&str>) -> Result<TokenSeal, String> {
    let key = match store {
        None => from_file(data).map_err(|e| {
            format!(
                "cannot read or create {}: {e}",
                data.join(KEY_FILE).display()
            )
        })?,
        Some(url) => from_database(url).map_err(|e| format!("the token key in the store: {e}"))?,
    };
    Ok(TokenSeal::new(key))
}

fn random_key() -> io::Result<[u8; 32]> {
    let mut key = [0u8; 32];
    getrandom::fill(&mut key).map_err(|e| io::Error::other(e.to_string()))?;
    Ok(key)
}

fn from_file(data: &Path) -> io::Result<[u8; 32]> {
    let path = data.join(KEY_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => bytes.try_into().map_err(|b: Vec<u8>| {
            io::Error::other(format!(
                "{} bytes, not 32 (remove it to make a new key: tokens in flight then fail)",
                b.len()
            ))
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let key = random_key()?;
            crate::tokens::write_private(&path, &key)?;
            Ok(key)
        }
        Err(e) => Err(e),
    }
}

fn from_database(url: &str) -> Result<[u8; 32], crate::pgstore::StoreError> {
    let mut db = crate::pgstore::Target::parse(url)?.connect()?;
    crate::pgstore::migrate(&mut db)?;
    let fresh = random_key().map_err(|e| crate::pgstore::StoreError::Node(e.to_string()))?;
    // The first node to start makes it; every node reads the one that won.
    db.execute(
        "INSERT INTO estop_secret (name, secret) VALUES ('effect_token', $1) ON CONFLICT (name) DO NOTHING",
        &[&fresh.as_slice()],
    )?;
    let row = db.query_one(
        "SELECT secret FROM estop_secret WHERE name = 'effect_token'",
        &[],
    )?;
    let secret: Vec<u8> = row.get(0);
    secret
        .try_into()
        .map_err(|_| crate::pgstore::StoreError::Node("estop_secret: not 32 bytes".into()))
}
