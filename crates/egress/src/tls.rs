//! TLS termination for CONNECT: the per-daemon CA (`DATA/egress-ca.key`, 0600, made on first
//! use; its certificate is what the sandbox trusts), leaf certificates per host made on demand
//! and cached (bounded), and the client side the proxy uses to reach the real host.

use anyhow::{Context, Result};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::sign::CertifiedKey;
use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Leaf certificates kept; past this the cache starts over (they are cheap to make again).
pub const LEAVES_MAX: usize = 1024;

pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    /// The CA certificate (PEM): what signs this proxy's leaves.
    pub cert_pem: String,
    /// What the sandbox trusts: the certificate, then the one it replaced while the rotation's
    /// overlap lasts (`egress-ca.previous.pem`, until `estop egress ca retire`).
    pub bundle_pem: String,
    leaves: Mutex<HashMap<String, Arc<CertifiedKey>>>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ca { .. }")
    }
}

/// The CA's name and uses: rebuilt the same on every load, so the stored key is all it takes
/// to sign (the leaves' authority key id is derived from the key).
fn ca_params() -> CertificateParams {
    let mut p = CertificateParams::default();
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.distinguished_name
        .push(DnType::CommonName, "estop egress CA");
    p.distinguished_name.push(DnType::OrganizationName, "estop");
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    p
}

/// Holds the CA's files in `dir` for this process alone (`DATA/egress-ca.lock`): two first
/// uses at once (two `estop run`s on a fresh data directory) would each make a CA and leave
/// one's key beside the other's certificate, and a rotation must not interleave with a load.
fn lock(dir: &Path) -> Result<std::fs::File> {
    let lock = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(dir.join("egress-ca.lock"))
        .with_context(|| format!("locking the egress CA in {}", dir.display()))?;
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive)?;
    Ok(lock)
}

/// Writes `bytes` to `dir/name` whole or not at all (a temp file, fsync, rename), mode 0600.
fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, dir.join(name))?;
    Ok(())
}

/// Finishes a rotation a crash interrupted after its commit point (`egress-ca.next.pem`
/// written: the old certificate is in `previous`, the new pair complete), or forgets one
/// interrupted before it (a lone `next.key`).
fn roll_forward(dir: &Path) -> Result<()> {
    let (next_key, next_pem) = (
        dir.join("egress-ca.next.key"),
        dir.join("egress-ca.next.pem"),
    );
    if next_pem.exists() {
        if next_key.exists() {
            std::fs::rename(&next_key, dir.join("egress-ca.key"))?;
        }
        std::fs::rename(&next_pem, dir.join("egress-ca.pem"))?;
    } else if next_key.exists() {
        std::fs::remove_file(&next_key)?;
    }
    std::fs::File::open(dir)?.sync_all()?;
    Ok(())
}

/// What `rotate` or `retire` did: SHA-256 fingerprints of the certificates (hex).
#[derive(Debug)]
pub struct Rotation {
    pub current: String,
    pub previous: Option<String>,
}

fn fingerprint(pem: &str) -> Result<String> {
    use sha2::Digest as _;
    let der = rustls_pemfile::certs(&mut pem.as_bytes())
        .next()
        .context("no certificate")??;
    Ok(sha2::Sha256::digest(der.as_ref())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Makes a new CA in `dir` (docs/EGRESS.md, "Rotating the CA"): the old key is gone, the old
/// certificate stays in the sandboxes' bundle (`egress-ca.previous.pem`) until [`retire`].
/// Supervisors already running keep signing with the key they loaded; new ones sign with the
/// new key and hand their sandbox both certificates.
pub fn rotate(dir: &Path) -> Result<Rotation> {
    let old = Ca::load_or_create(dir)?;
    let _held = lock(dir)?;
    roll_forward(dir)?;
    let current = std::fs::read_to_string(dir.join("egress-ca.pem"))?;
    anyhow::ensure!(
        current == old.cert_pem,
        "the egress CA changed while rotating it; run the rotation again"
    );
    write_atomic(dir, "egress-ca.previous.pem", current.as_bytes())?;
    let key = KeyPair::generate()?;
    let cert = ca_params().self_signed(&key)?;
    write_atomic(dir, "egress-ca.next.key", key.serialize_pem().as_bytes())?;
    write_atomic(dir, "egress-ca.next.pem", cert.pem().as_bytes())?; // the commit point
    roll_forward(dir)?;
    Ok(Rotation {
        current: fingerprint(&cert.pem())?,
        previous: Some(fingerprint(&current)?),
    })
}

/// Ends a rotation's overlap: sandboxes started from now on trust the current CA alone.
pub fn retire(dir: &Path) -> Result<Rotation> {
    let _held = lock(dir)?;
    roll_forward(dir)?;
    let previous = dir.join("egress-ca.previous.pem");
    let was = match std::fs::read_to_string(&previous) {
        Ok(pem) => Some(fingerprint(&pem)?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(e.into()),
    };
    if was.is_some() {
        std::fs::remove_file(&previous)?;
        std::fs::File::open(dir)?.sync_all()?;
    }
    let current = std::fs::read_to_string(dir.join("egress-ca.pem"))
        .context("no egress CA in this data directory")?;
    Ok(Rotation {
        current: fingerprint(&current)?,
        previous: was,
    })
}

impl Ca {
    /// Loads the CA from `dir`, or makes it there (key 0600) the first time.
    pub fn load_or_create(dir: &Path) -> Result<Ca> {
        let (key_path, cert_path) = (dir.join("egress-ca.key"), dir.join("egress-ca.pem"));
        let _held = lock(dir)?;
        roll_forward(dir)?;
        let (key, cert_pem) = if key_path.exists() && cert_path.exists() {
            let key = KeyPair::from_pem(&std::fs::read_to_string(&key_path)?)
                .with_context(|| format!("{} is not a key", key_path.display()))?;
            (key, std::fs::read_to_string(&cert_path)?)
        } else {
            let key = KeyPair::generate()?;
            let cert = ca_params().self_signed(&key)?;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&key_path)
                .with_context(|| format!("writing {}", key_path.display()))?;
            f.write_all(key.serialize_pem().as_bytes())?;
            f.sync_all()?;
            std::fs::write(&cert_path, cert.pem())?;
            (key, cert.pem())
        };
        let bundle_pem = match std::fs::read_to_string(dir.join("egress-ca.previous.pem")) {
            Ok(previous) => format!("{cert_pem}{previous}"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => cert_pem.clone(),
            Err(e) => return Err(e.into()),
        };
        Ok(Ca {
            issuer: Issuer::new(ca_params(), key),
            bundle_pem,
            cert_pem,
            leaves: Mutex::default(),
            provider: Arc::new(rustls::crypto::ring::default_provider()),
        })
    }

    /// A certificate for `host` (a name or an IP address), signed by the CA.
    pub fn leaf(&self, host: &str) -> Result<Arc<CertifiedKey>> {
        if let Some(k) = self.leaves.lock().expect("not poisoned").get(host) {
            return Ok(k.clone());
        }
        let mut params = CertificateParams::new(vec![host.to_string()])?;
        params.distinguished_name.push(DnType::CommonName, host);
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let signing = self.provider.key_provider.load_private_key(der)?;
        let certified = Arc::new(CertifiedKey::new(vec![cert.der().clone()], signing));
        let mut leaves = self.leaves.lock().expect("not poisoned");
        if leaves.len() >= LEAVES_MAX {
            leaves.clear();
        }
        leaves.insert(host.to_string(), certified.clone());
        Ok(certified)
    }

    /// The server side of one tunnel: it presents the leaf of the host the agent asked to
    /// CONNECT to, whatever name the client hello carries (none, for an IP address).
    pub fn acceptor(&self, host: &str) -> Result<tokio_rustls::TlsAcceptor> {
        let leaf = self.leaf(host)?;
        let mut config = rustls::ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(Fixed(leaf)));
        // HTTP/2 when the agent's client offers it, HTTP/1.1 otherwise (or with no ALPN).
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
    }
}

#[derive(Debug)]
struct Fixed(Arc<CertifiedKey>);

impl rustls::server::ResolvesServerCert for Fixed {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// How the proxy reaches real hosts: the public web PKI (webpki roots), plus the roots of
/// `extra_roots` (a PEM file) when given.
pub fn connector(extra_roots: Option<&Path>) -> Result<tokio_rustls::TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = extra_roots {
        let pem = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        for cert in rustls_pemfile::certs(&mut pem.as_slice()) {
            let cert: CertificateDer<'static> = cert?;
            roots.add(cert).context("an upstream root certificate")?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = crate::upstream::ALPN.iter().map(|p| p.to_vec()).collect();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

#[cfg(test)]
mod tests {
    #[test]
    fn first_uses_at_once_make_one_ca() {
        let dir = tempfile::tempdir().unwrap();
        let pems: Vec<String> = std::thread::scope(|s| {
            let all: Vec<_> = (0..8)
                .map(|_| s.spawn(|| super::Ca::load_or_create(dir.path()).unwrap().cert_pem))
                .collect();
            all.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let on_disk = std::fs::read_to_string(dir.path().join("egress-ca.pem")).unwrap();
        assert!(
            pems.iter().all(|p| *p == on_disk),
            "every caller holds the CA on disk"
        );
    }

    #[test]
    fn the_ca_is_made_once_with_a_private_key_and_signs_leaves() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let ca = super::Ca::load_or_create(dir.path()).unwrap();
        let mode = std::fs::metadata(dir.path().join("egress-ca.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let again = super::Ca::load_or_create(dir.path()).unwrap();
        assert_eq!(ca.cert_pem, again.cert_pem, "loaded, not made again");
        let a = ca.leaf("example.test").unwrap();
        assert!(
            std::sync::Arc::ptr_eq(&a, &ca.leaf("example.test").unwrap()),
            "cached"
        );
        ca.leaf("127.0.0.2").unwrap();
    }

    /// Whether a client trusting `bundle` (PEM) accepts the leaf `ca` presents for a host.
    async fn trusted(bundle: &str, ca: &super::Ca) -> bool {
        use std::sync::Arc;
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_pemfile::certs(&mut bundle.as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let (client, server) = tokio::io::duplex(64 * 1024);
        let acceptor = ca.acceptor("example.test").unwrap();
        tokio::spawn(async move {
            let _ = acceptor.accept(server).await;
        });
        let name = rustls::pki_types::ServerName::try_from("example.test").unwrap();
        tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, client)
            .await
            .is_ok()
    }

    /// A rotation: new sandboxes get the new CA's leaves and trust old and new; a proxy still
    /// signing with the old key (a supervisor started before) is trusted by that bundle too;
    /// the old bundle does not trust the new CA; after `retire`, only the new CA is trusted,
    /// and the old key is gone from the directory.
    #[tokio::test]
    async fn a_rotation_overlaps_old_and_new_until_retired() {
        let dir = tempfile::tempdir().unwrap();
        let old = super::Ca::load_or_create(dir.path()).unwrap();
        assert_eq!(old.bundle_pem, old.cert_pem, "no overlap before a rotation");
        let old_key = std::fs::read(dir.path().join("egress-ca.key")).unwrap();
        let r = super::rotate(dir.path()).unwrap();
        assert_ne!(Some(&r.current), r.previous.as_ref());
        let new = super::Ca::load_or_create(dir.path()).unwrap();
        assert_ne!(new.cert_pem, old.cert_pem, "a new CA");
        assert_ne!(
            std::fs::read(dir.path().join("egress-ca.key")).unwrap(),
            old_key
        );
        assert!(
            trusted(&new.bundle_pem, &new).await,
            "new leaves, new bundle"
        );
        assert!(
            trusted(&new.bundle_pem, &old).await,
            "old leaves, during the overlap"
        );
        assert!(
            !trusted(&old.bundle_pem, &new).await,
            "the old bundle is not the new CA's"
        );
        let retired = super::retire(dir.path()).unwrap();
        assert_eq!(retired.previous, r.previous);
        let after = super::Ca::load_or_create(dir.path()).unwrap();
        assert_eq!(after.bundle_pem, new.cert_pem);
        assert!(trusted(&after.bundle_pem, &new).await);
        assert!(
            !trusted(&after.bundle_pem, &old).await,
            "the old CA is no longer trusted"
        );
        assert!(
            super::retire(dir.path()).unwrap().previous.is_none(),
            "nothing to retire"
        );
    }

    /// A crash after the rotation's commit point (the new pair written as `next`) is finished
    /// by the next load; one before it leaves the CA as it was.
    #[test]
    fn an_interrupted_rotation_is_finished_or_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let old = super::Ca::load_or_create(d).unwrap();
        std::fs::write(d.join("egress-ca.next.key"), "half").unwrap();
        let same = super::Ca::load_or_create(d).unwrap();
        assert_eq!(same.cert_pem, old.cert_pem);
        assert!(!d.join("egress-ca.next.key").exists());
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = super::ca_params().self_signed(&key).unwrap();
        std::fs::write(d.join("egress-ca.previous.pem"), &old.cert_pem).unwrap();
        std::fs::write(d.join("egress-ca.next.key"), key.serialize_pem()).unwrap();
        std::fs::write(d.join("egress-ca.next.pem"), cert.pem()).unwrap();
        let rolled = super::Ca::load_or_create(d).unwrap();
        assert_eq!(rolled.cert_pem, cert.pem());
        assert_eq!(rolled.bundle_pem, format!("{}{}", cert.pem(), old.cert_pem));
    }
}
