//! TLS to the database (docs/STORES.md): libpq's `sslmode` and `sslrootcert` read out of the
//! store's URL before `tokio-postgres` parses the rest (it knows only `disable`, `prefer` and
//! `require`, and no root certificates), over rustls with the ring provider.
//!
//! The modes mean what they mean to libpq: `disable` never encrypts; `prefer` (the default)
//! encrypts when the server offers it; `require` always encrypts, and checks the server's
//! certificate only against `sslrootcert` if one is given; `verify-ca` checks the chain
//! against `sslrootcert`; `verify-full` checks the chain and that the certificate names the host
//! connected to. `sslrootcert=system` means Mozilla's roots (`webpki-roots`).

/// A URL's TLS options that cannot be used, in words (the store reports it as `store_url`).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TlsOptionError(pub String);
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, Error, RootCertStore, SignatureScheme};
use std::sync::Arc;
use tokio_postgres::config::SslMode;
use tokio_postgres_rustls::MakeRustlsConnect;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl Mode {
    fn parse(value: &str) -> Result<Mode, TlsOptionError> {
        Ok(match value {
            "disable" => Mode::Disable,
            "prefer" => Mode::Prefer,
            "require" => Mode::Require,
            "verify-ca" => Mode::VerifyCa,
            "verify-full" => Mode::VerifyFull,
            other => {
                return Err(TlsOptionError(format!(
                    "sslmode={other}: estop knows disable, prefer, require, verify-ca and verify-full"
                )));
            }
        })
    }

    /// What `tokio-postgres` is told: whether to ask for TLS, and whether to insist.
    pub fn ssl_mode(self) -> SslMode {
        match self {
            Mode::Disable => SslMode::Disable,
            Mode::Prefer => SslMode::Prefer,
            Mode::Require | Mode::VerifyCa | Mode::VerifyFull => SslMode::Require,
        }
    }
}

/// A URL's TLS options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    pub mode: Mode,
    /// The root certificates' file (PEM), or `system`.
    pub root: Option<String>,
    /// The client certificate (chain) and its private key, files in PEM: both or neither.
    pub client: Option<(String, String)>,
}

/// The URL without its TLS options, and the options.
pub fn split(url: &str) -> Result<(String, Options), TlsOptionError> {
    let mut mode = None;
    let mut root = None;
    let (mut cert, mut key) = (None, None);
    let mut take = |key_: &str, value: &str| -> Result<bool, TlsOptionError> {
        match key_ {
            "sslmode" => mode = Some(Mode::parse(value)?),
            "sslrootcert" => root = Some(value.to_string()),
            "sslcert" => cert = Some(value.to_string()),
            "sslkey" => key = Some(value.to_string()),
            _ => return Ok(false),
        }
        Ok(true)
    };
    let rest = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        match url.split_once('?') {
            None => url.to_string(),
            Some((base, query)) => {
                let mut kept = Vec::new();
                for pair in query.split('&') {
                    let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                    if !take(k, &percent_decode(v)?)? {
                        kept.push(pair);
                    }
                }
                if kept.is_empty() {
                    base.to_string()
                } else {
                    format!("{base}?{}", kept.join("&"))
                }
            }
        }
    } else {
        let mut kept = Vec::new();
        for word in url.split_whitespace() {
            let (k, v) = word.split_once('=').unwrap_or((word, ""));
            if !take(k.trim(), v.trim())? {
                kept.push(word);
            }
        }
        kept.join(" ")
    };
    let mode = mode.unwrap_or(Mode::Prefer);
    if matches!(mode, Mode::VerifyCa | Mode::VerifyFull) && root.is_none() {
        return Err(TlsOptionError(
            "sslmode=verify-ca and verify-full need sslrootcert=FILE (the CA's certificates, PEM) or sslrootcert=system".into(),
        ));
    }
    let client = match (cert, key) {
        (None, None) => None,
        (Some(c), Some(k)) if mode != Mode::Disable => Some((c, k)),
        (Some(_), Some(_)) => {
            return Err(TlsOptionError(
                "sslcert and sslkey with sslmode=disable: a client certificate needs TLS".into(),
            ));
        }
        _ => {
            return Err(TlsOptionError(
                "sslcert and sslkey go together: the client certificate (PEM) and its private key (PEM)".into(),
            ));
        }
    };
    Ok((rest, Options { mode, root, client }))
}

fn percent_decode(s: &str) -> Result<String, TlsOptionError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| TlsOptionError(format!("bad percent escape in {s:?}")))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| TlsOptionError(format!("{s:?} is not UTF-8")))
}

/// The TLS connector for the options (unused when the mode is `disable`); the client
/// certificate and key files are read now, so one that is missing or unreadable stops the start.
pub fn connector(o: &Options) -> Result<MakeRustlsConnect, TlsOptionError> {
    let (mode, root) = (o.mode, o.root.as_deref());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsOptionError(format!("TLS: {e}")))?;
    let verifier: Arc<dyn ServerCertVerifier> = match root {
        None => Arc::new(Unchecked(provider.signature_verification_algorithms)),
        Some(root) => {
            let webpki =
                WebPkiServerVerifier::builder_with_provider(Arc::new(roots(root)?), provider)
                    .build()
                    .map_err(|e| TlsOptionError(format!("sslrootcert={root}: {e}")))?;
            match mode {
                Mode::VerifyFull => webpki,
                _ => Arc::new(AnyName(webpki)),
            }
        }
    };
    let builder = builder
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let config = match &o.client {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let (chain, key_der) = client_identity(cert, key)?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| TlsOptionError(format!("sslcert={cert} with sslkey={key}: {e}")))?
        }
    };
    Ok(MakeRustlsConnect::new(config))
}

/// The client certificate chain of `cert` and the private key of `key` (PEM files). The key
/// is refused if others than its owner may read it, as libpq does.
fn client_identity(
    cert: &str,
    key: &str,
) -> Result<
    (
        Vec<CertificateDer<'static>>,
        rustls::pki_types::PrivateKeyDer<'static>,
    ),
    TlsOptionError,
> {
    use std::os::unix::fs::PermissionsExt;
    let bad = |what: &str, path: &str, e: &dyn std::fmt::Display| {
        TlsOptionError(format!("{what}={path}: {e}"))
    };
    let pem = std::fs::read(cert).map_err(|e| bad("sslcert", cert, &e))?;
    let chain = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad("sslcert", cert, &e))?;
    if chain.is_empty() {
        return Err(bad("sslcert", cert, &"no certificate in it"));
    }
    let mode = std::fs::metadata(key)
        .map_err(|e| bad("sslkey", key, &e))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        return Err(bad(
            "sslkey",
            key,
            &format!(
                "mode {:o}: a private key must be readable by its owner only (chmod 600)",
                mode & 0o777
            ),
        ));
    }
    let pem = std::fs::read(key).map_err(|e| bad("sslkey", key, &e))?;
    let key_der = rustls_pemfile::private_key(&mut pem.as_slice())
        .map_err(|e| bad("sslkey", key, &e))?
        .ok_or_else(|| bad("sslkey", key, &"no private key in it"))?;
    Ok((chain, key_der))
}

fn roots(root: &str) -> Result<RootCertStore, TlsOptionError> {
    if root == "system" {
        return Ok(RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        });
    }
    let bad = |e: &dyn std::fmt::Display| TlsOptionError(format!("sslrootcert={root}: {e}"));
    let pem = std::fs::read(root).map_err(|e| bad(&e))?;
    let mut store = RootCertStore::empty();
    for cert in rustls_pemfile::certs(&mut pem.as_slice()) {
        store.add(cert.map_err(|e| bad(&e))?).map_err(|e| bad(&e))?;
    }
    if store.is_empty() {
        return Err(bad(&"no certificate in it"));
    }
    Ok(store)
}

/// `prefer` and `require` without `sslrootcert`, as libpq: encrypted, the server's certificate
/// not checked (the handshake's signatures are).
#[derive(Debug)]
struct Unchecked(WebPkiSupportedAlgorithms);

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_schemes()
    }
}

/// `verify-ca` (and `require` with `sslrootcert`): the chain checked against the roots, the
/// name in the certificate not.
#[derive(Debug)]
struct AnyName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_options_are_read_out_of_urls_and_key_value_strings() {
        let (rest, o) = split(
            "postgres://u@h:5/db?sslmode=verify-full&application_name=x&sslrootcert=%2Fca.pem",
        )
        .unwrap();
        assert_eq!(
            (rest.as_str(), o.mode, o.root.as_deref()),
            (
                "postgres://u@h:5/db?application_name=x",
                Mode::VerifyFull,
                Some("/ca.pem")
            )
        );
        let (rest, o) = split("host=h dbname=d sslmode=require").unwrap();
        assert_eq!(
            (rest.as_str(), o.mode, o.root),
            ("host=h dbname=d", Mode::Require, None)
        );
        assert_eq!(split("postgres://h/d").unwrap().1.mode, Mode::Prefer);
        let (rest, o) = split("postgres://h/d?sslcert=%2Fc.pem&sslkey=/k.pem").unwrap();
        assert_eq!(
            (rest.as_str(), o.client),
            ("postgres://h/d", Some(("/c.pem".into(), "/k.pem".into())))
        );
        let e = split("postgres://h/d?sslcert=/c.pem").unwrap_err();
        assert!(e.to_string().contains("go together"), "{e}");
        let e = split("host=h sslkey=/k.pem sslcert=/c.pem sslmode=disable").unwrap_err();
        assert!(e.to_string().contains("needs TLS"), "{e}");
        let e = split("postgres://h/d?sslmode=verify-full").unwrap_err();
        assert!(e.to_string().contains("sslrootcert"), "{e}");
        let e = split("postgres://h/d?sslmode=allow").unwrap_err();
        assert!(e.to_string().contains("sslmode=allow"), "{e}");
    }
}
