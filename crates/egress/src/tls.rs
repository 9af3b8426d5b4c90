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
    /// The CA certificate (PEM), handed to the sandbox as its trust bundle.
    pub cert_pem: String,
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

impl Ca {
    /// Loads the CA from `dir`, or makes it there (key 0600) the first time.
    pub fn load_or_create(dir: &Path) -> Result<Ca> {
        let (key_path, cert_path) = (dir.join("egress-ca.key"), dir.join("egress-ca.pem"));
        // Two first uses at once (two `estop run`s on a fresh data directory) would each make
        // a CA and leave one's key beside the other's certificate: one at a time.
        let lock = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(dir.join("egress-ca.lock"))
            .with_context(|| format!("locking the egress CA in {}", dir.display()))?;
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive)?;
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
        Ok(Ca {
            issuer: Issuer::new(ca_params(), key),
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
}
