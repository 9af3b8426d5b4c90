//! Named tokens with roles (SPEC §3 "Principals"): the registry of who may talk to the gate.
//! Only SHA-256 hashes of secrets are stored (`DATA/tokens`, mode 0600); the secrets themselves
//! are shown once, and the bootstrap ones are written to `operator.token` and `agent.token`.

use estop_kernel::{Principal, PrincipalName, Role};
use sha2::{Digest as _, Sha256};
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::RwLock;

/// Names the gate uses for itself and the compatibility listener; no token may take them.
pub const RESERVED_NAMES: &[&str] = &["estop", "soundgate"];
/// Tokens the registry holds at most.
pub const TOKENS_MAX: usize = 10_000;
/// Groups one principal may carry.
pub const GROUPS_MAX: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("{path} line {line}: {problem}")]
    Corrupt {
        path: PathBuf,
        line: usize,
        problem: String,
    },
    #[error("a token named {0} already exists")]
    Exists(String),
    #[error("the name {0} is reserved")]
    Reserved(String),
    #[error("invalid token name or group: {0}")]
    Invalid(String),
    #[error("limit reached: tokens_max = {TOKENS_MAX}")]
    Full,
}

#[derive(Debug, Clone)]
struct Entry {
    principal: Principal,
    hash: [u8; 32],
}

/// The token registry of one data dir.
#[derive(Debug)]
pub struct Tokens {
    path: PathBuf,
    entries: RwLock<Vec<Entry>>,
}

fn hash(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A fresh secret: 32 random bytes from the OS, hex-encoded, with a prefix naming the role
/// so a leaked secret is recognisable in a scan.
pub fn new_secret(role: Role) -> Result<String, TokenError> {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).map_err(|e| TokenError::Io {
        op: "read randomness for",
        path: PathBuf::from("a new token"),
        source: io::Error::other(e.to_string()),
    })?;
    let prefix = match role {
        Role::Operator => "estop_op_",
        Role::Agent => "estop_ag_",
    };
    Ok(format!("{prefix}{}", hex(&b)))
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.@".contains(&b))
}

/// Writes `bytes` to `path` atomically with mode 0600 (tmp + fsync + rename + dir fsync).
pub fn write_private(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .mode(0o600)
            .open(&tmp)?;
        f.set_permissions(fs::Permissions::from_mode(0o600))?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

impl Tokens {
    /// Opens the registry of `data`, creating the bootstrap tokens (`admin` operator and `agent`)
    /// on first start. Returns the registry and whether it was created now.
    pub fn open_or_bootstrap(data: &Path) -> Result<(Tokens, bool), TokenError> {
        let path = data.join("tokens");
        let io = |op: &'static str, p: &Path| {
            let p = p.to_path_buf();
            move |source| TokenError::Io {
                op,
                path: p,
                source,
            }
        };
        if !path.exists() {
            let tokens = Tokens {
                path: path.clone(),
                entries: RwLock::new(Vec::new()),
            };
            let op = tokens.create_entry("admin", Role::Operator, &[])?;
            let ag = tokens.create_entry("agent", Role::Agent, &[])?;
            // Secrets first, registry last: a crash in between leaves no registry, so the
            // next start bootstraps again and overwrites the secret files.
            write_private(&data.join("operator.token"), format!("{op}\n").as_bytes())
                .map_err(io("write", &data.join("operator.token")))?;
            write_private(&data.join("agent.token"), format!("{ag}\n").as_bytes())
                .map_err(io("write", &data.join("agent.token")))?;
            tokens.save()?;
            return Ok((tokens, true));
        }
        let text = fs::read_to_string(&path).map_err(io("read", &path))?;
        let mut entries = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let corrupt = |problem: &str| TokenError::Corrupt {
                path: path.clone(),
                line: i + 1,
                problem: problem.into(),
            };
            if line.trim().is_empty() || line.starts_with('#') {
                continue;
            }
            let f: Vec<&str> = line.split('\t').collect();
            if f.len() != 4 {
                return Err(corrupt(
                    "expected name, role, groups, sha256 separated by tabs",
                ));
            }
            let name = PrincipalName::new(f[0]).map_err(|e| corrupt(&e.to_string()))?;
            let role =
                Role::parse(f[1]).ok_or_else(|| corrupt("role must be agent or operator"))?;
            let groups = f[2]
                .split(',')
                .filter(|g| !g.is_empty())
                .map(Into::into)
                .collect();
            let mut h = [0u8; 32];
            let digest =
                estop_kernel::Digest::from_hex(f[3]).ok_or_else(|| corrupt("bad sha256"))?;
            h.copy_from_slice(&digest.0);
            entries.push(Entry {
                principal: Principal { name, role, groups },
                hash: h,
            });
        }
        Ok((
            Tokens {
                path,
                entries: RwLock::new(entries),
            },
            false,
        ))
    }

    fn save(&self) -> Result<(), TokenError> {
        let mut text = String::from(
            "# estop tokens: name, role, groups, sha256(secret). Secrets are never stored.\n",
        );
        for e in self.entries.read().expect("tokens lock").iter() {
            let groups: Vec<&str> = e.principal.groups.iter().map(|g| &**g).collect();
            text.push_str(&format!(
                "{}\t{}\t{}\t{}\n",
                e.principal.name,
                e.principal.role.as_str(),
                groups.join(","),
                hex(&e.hash)
            ));
        }
        write_private(&self.path, text.as_bytes()).map_err(|source| TokenError::Io {
            op: "write",
            path: self.path.clone(),
            source,
        })
    }

    fn create_entry(
        &self,
        name: &str,
        role: Role,
        groups: &[String],
    ) -> Result<String, TokenError> {
        if RESERVED_NAMES.contains(&name) {
            return Err(TokenError::Reserved(name.into()));
        }
        if !valid_name(name) {
            return Err(TokenError::Invalid(format!(
                "{name:?}: use 1-64 of A-Z a-z 0-9 - _ . @"
            )));
        }
        if groups.len() > GROUPS_MAX || groups.iter().any(|g| !valid_name(g)) {
            return Err(TokenError::Invalid(format!(
                "groups {groups:?}: at most {GROUPS_MAX}, each 1-64 of A-Z a-z 0-9 - _ . @"
            )));
        }
        let mut entries = self.entries.write().expect("tokens lock");
        if entries.iter().any(|e| e.principal.name.as_str() == name) {
            return Err(TokenError::Exists(name.into()));
        }
        if entries.len() >= TOKENS_MAX {
            return Err(TokenError::Full);
        }
        let secret = new_secret(role)?;
        let principal = Principal {
            name: PrincipalName::new(name).map_err(|e| TokenError::Invalid(e.to_string()))?,
            role,
            groups: groups.iter().map(|g| g.as_str().into()).collect(),
        };
        entries.push(Entry {
            principal,
            hash: hash(&secret),
        });
        Ok(secret)
    }

    /// Creates a named token and persists the registry; returns the secret (shown once).
    pub fn create(&self, name: &str, role: Role, groups: &[String]) -> Result<String, TokenError> {
        let secret = self.create_entry(name, role, groups)?;
        if let Err(e) = self.save() {
            // Nothing half-applied: forget the entry the file does not hold.
            self.entries
                .write()
                .expect("tokens lock")
                .retain(|x| x.principal.name.as_str() != name);
            return Err(e);
        }
        Ok(secret)
    }

    /// The principal a secret belongs to.
    pub fn authenticate(&self, secret: &str) -> Option<Principal> {
        let h = hash(secret.trim());
        self.entries
            .read()
            .expect("tokens lock")
            .iter()
            .find(|e| e.hash == h)
            .map(|e| e.principal.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bootstrap_creates_admin_and_agent_with_private_files() {
        let dir = tempfile::tempdir().unwrap();
        let (tokens, created) = Tokens::open_or_bootstrap(dir.path()).unwrap();
        assert!(created);
        let op = fs::read_to_string(dir.path().join("operator.token")).unwrap();
        let ag = fs::read_to_string(dir.path().join("agent.token")).unwrap();
        assert_eq!(tokens.authenticate(&op).unwrap().name.as_str(), "admin");
        assert_eq!(tokens.authenticate(&ag).unwrap().role, Role::Agent);
        for f in ["operator.token", "agent.token", "tokens"] {
            let mode = fs::metadata(dir.path().join(f))
                .unwrap()
                .permissions()
                .mode()
                & 0o777;
            assert_eq!(mode, 0o600, "{f}");
        }
        let registry = fs::read_to_string(dir.path().join("tokens")).unwrap();
        assert!(
            !registry.contains(op.trim()),
            "the registry must not hold secrets"
        );
        // Reopen: same principals, not re-created.
        let (again, created) = Tokens::open_or_bootstrap(dir.path()).unwrap();
        assert!(!created);
        assert_eq!(again.authenticate(&op).unwrap().name.as_str(), "admin");
    }

    #[test]
    fn create_refuses_duplicates_reserved_and_bad_names() {
        let dir = tempfile::tempdir().unwrap();
        let (tokens, _) = Tokens::open_or_bootstrap(dir.path()).unwrap();
        let s = tokens
            .create("bob", Role::Operator, &["finance".into()])
            .unwrap();
        let p = tokens.authenticate(&s).unwrap();
        assert_eq!(p.groups, vec![Box::<str>::from("finance")]);
        assert!(matches!(
            tokens.create("bob", Role::Agent, &[]),
            Err(TokenError::Exists(_))
        ));
        assert!(matches!(
            tokens.create("estop", Role::Agent, &[]),
            Err(TokenError::Reserved(_))
        ));
        assert!(matches!(
            tokens.create("a b", Role::Agent, &[]),
            Err(TokenError::Invalid(_))
        ));
        assert!(tokens.authenticate("nope").is_none());
    }
}
