//! TLS for the whole process: one crypto provider (ring), the roots a client trusts, and the server's
//! certificate.
//!
//! Clients (external MCP servers over `https://`, and the host's upstream engines) trust the system's
//! roots plus the CA files the operator adds (`--tls-ca`), set once by [`trust`] before any client is
//! built; [`http_client`] is a `reqwest` builder with that configuration. The server's certificate and key
//! are read by [`ServerCert`], which a listener asks on every handshake, so a reload (SIGHUP) takes
//! effect for the next connection without dropping the open ones.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock, RwLock};

/// What went wrong reading TLS material.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or parsed as PEM.
    #[error("{path}: {msg}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        msg: String,
    },
    /// rustls refused the material (a key that does not match its certificate, an unsupported key).
    #[error("{what}: {source}")]
    Rustls {
        /// What was being set up.
        what: String,
        /// rustls's reason.
        source: rustls::Error,
    },
    /// [`trust`] was called after a client had been built (or twice).
    #[error("the TLS roots were already set")]
    AlreadySet,
}

/// The process's crypto provider, installed on first use.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Another thread may install it first; either way one provider serves the process. ring, not
        // aws-lc-rs: a small C build that cross-compiles to every edge target; the price is no
        // post-quantum key exchange (X25519MLKEM768), which rustls offers with aws-lc-rs only.
        #[allow(deprecated, reason = "ring is kept on purpose: see the comment above")]
        let ring = rustls::crypto::ring::default_provider();
        let _ = ring.install_default();
    }
    Arc::clone(rustls::crypto::CryptoProvider::get_default().expect("installed above"))
}

static EXTRA: OnceLock<Vec<CertificateDer<'static>>> = OnceLock::new();
static CLIENT: OnceLock<Arc<rustls::ClientConfig>> = OnceLock::new();

/// Sets the roots clients trust: the system's plus the certificates in `extra` (PEM files, each may hold
/// several), read now (a bad file is an error at once). Call it once, before the first client is built;
/// the system's store is read when the first client is. Returns how many certificates `extra` held.
pub fn trust(extra: &[PathBuf]) -> Result<usize, TlsError> {
    let mut certs = Vec::new();
    for path in extra {
        certs.extend(certificates(path)?);
    }
    let n = certs.len();
    if CLIENT.get().is_some() {
        return Err(TlsError::AlreadySet);
    }
    EXTRA.set(certs).map_err(|_| TlsError::AlreadySet)?;
    Ok(n)
}

/// The certificates given to [`trust`] (for clients that take roots of their own).
pub fn extra_roots() -> &'static [CertificateDer<'static>] {
    EXTRA.get().map_or(&[], Vec::as_slice)
}

/// The client configuration: the system's roots and those given to [`trust`].
pub fn client() -> Arc<rustls::ClientConfig> {
    let extra = EXTRA.get().map_or(&[][..], Vec::as_slice);
    Arc::clone(CLIENT.get_or_init(|| match client_config(extra) {
        Ok((c, _)) => c,
        Err(e) => {
            // Not expected (the extra roots parsed); a client with no roots refuses every server.
            tracing::warn!(error = %e, "TLS roots");
            Arc::new(
                rustls::ClientConfig::builder_with_provider(provider())
                    .with_safe_default_protocol_versions()
                    .expect("ring supports the default versions")
                    .with_root_certificates(rustls::RootCertStore::empty())
                    .with_no_client_auth(),
            )
        }
    }))
}

/// A `reqwest` client builder whose TLS is [`client`]'s.
pub fn http_client() -> reqwest::ClientBuilder {
    reqwest::Client::builder().tls_backend_preconfigured((*client()).clone())
}

fn client_config(
    extra: &[CertificateDer<'static>],
) -> Result<(Arc<rustls::ClientConfig>, usize), TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    let system = rustls_native_certs::load_native_certs();
    for e in &system.errors {
        tracing::debug!(error = %e, "a system root store could not be read");
    }
    roots.add_parsable_certificates(system.certs);
    for c in extra {
        roots.add(c.clone()).map_err(|source| TlsError::Rustls {
            what: "a --tls-ca certificate".into(),
            source,
        })?;
    }
    let n = roots.len();
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls {
            what: "the client configuration".into(),
            source,
        })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok((Arc::new(config), n))
}

/// The certificates of a PEM file (at least one).
fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bad = |msg: String| TlsError::File {
        path: path.to_owned(),
        msg,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no PEM certificate in it".into()));
    }
    Ok(certs)
}

/// The server's certificate chain and key, read from two PEM files, replaceable while it serves.
#[derive(Debug)]
pub struct ServerCert {
    cert: PathBuf,
    key: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
}

impl ServerCert {
    /// Reads `cert` (the chain, leaf first) and `key` (PKCS#8, PKCS#1 or SEC1), checking that they match.
    pub fn load(cert: &Path, key: &Path) -> Result<Arc<Self>, TlsError> {
        Ok(Arc::new(ServerCert {
            current: RwLock::new(Arc::new(read_pair(cert, key)?)),
            cert: cert.to_owned(),
            key: key.to_owned(),
        }))
    }

    /// Reads the files again; on an error the certificate served so far stays.
    pub fn reload(&self) -> Result<(), TlsError> {
        let fresh = Arc::new(read_pair(&self.cert, &self.key)?);
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = fresh;
        Ok(())
    }

    /// The server configuration that serves this certificate (HTTP/1.1).
    pub fn server_config(self: &Arc<Self>) -> Arc<rustls::ServerConfig> {
        let mut c = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default versions")
            .with_no_client_auth()
            .with_cert_resolver(Arc::clone(self) as Arc<dyn rustls::server::ResolvesServerCert>);
        c.alpn_protocols = vec![b"http/1.1".to_vec()];
        Arc::new(c)
    }

    /// The certificate files.
    pub fn paths(&self) -> (&Path, &Path) {
        (&self.cert, &self.key)
    }
}

impl ServerCert {
    /// The chain and key served now.
    pub fn current(&self) -> Arc<CertifiedKey> {
        Arc::clone(&self.current.read().unwrap_or_else(|e| e.into_inner()))
    }
}

impl rustls::server::ResolvesServerCert for ServerCert {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

fn read_pair(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
    let chain = certificates(cert)?;
    let der = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::File {
        path: key.to_owned(),
        msg: format!("no usable PEM private key: {e}"),
    })?;
    CertifiedKey::from_der(chain, der, &provider()).map_err(|source| TlsError::Rustls {
        what: format!("{} with {}", cert.display(), key.display()),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate for localhost, written as PEM: (cert, key).
    fn pair(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let c = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        let (cert, key) = (
            dir.join(format!("{name}.pem")),
            dir.join(format!("{name}.key")),
        );
        std::fs::write(&cert, c.cert.pem()).unwrap();
        std::fs::write(&key, c.signing_key.serialize_pem()).unwrap();
        (cert, key)
    }

    /// A TLS handshake in memory between `server` and a client that trusts `root` only.
    fn handshake(server: Arc<rustls::ServerConfig>, root: &Path) -> Result<(), rustls::Error> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(certificates(root).unwrap().remove(0)).unwrap();
        let client = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let mut c = rustls::ClientConnection::new(Arc::new(client), name)?;
        let mut s = rustls::ServerConnection::new(server)?;
        for _ in 0..10 {
            let mut buf = Vec::new();
            c.write_tls(&mut buf).unwrap();
            s.read_tls(&mut buf.as_slice()).unwrap();
            s.process_new_packets()?;
            let mut buf = Vec::new();
            s.write_tls(&mut buf).unwrap();
            c.read_tls(&mut buf.as_slice()).unwrap();
            c.process_new_packets()?;
            if !c.is_handshaking() && !s.is_handshaking() {
                return Ok(());
            }
        }
        panic!("the handshake did not finish");
    }

    #[test]
    fn a_reload_serves_the_new_certificate_and_a_bad_one_keeps_the_old() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = pair(dir.path(), "server");
        let served = ServerCert::load(&cert, &key).unwrap();
        let config = served.server_config();
        let first = dir.path().join("first.pem");
        std::fs::copy(&cert, &first).unwrap();
        handshake(Arc::clone(&config), &first).unwrap();

        // New files in place, then a reload: the same configuration serves the new certificate.
        let (c2, k2) = pair(dir.path(), "next");
        std::fs::copy(&c2, &cert).unwrap();
        std::fs::copy(&k2, &key).unwrap();
        served.reload().unwrap();
        handshake(Arc::clone(&config), &c2).unwrap();
        assert!(handshake(Arc::clone(&config), &first).is_err());

        // A key that is not the certificate's: refused, and the certificate served stays.
        let (_, other_key) = pair(dir.path(), "other");
        std::fs::copy(&other_key, &key).unwrap();
        let e = served.reload().unwrap_err();
        assert!(matches!(e, TlsError::Rustls { .. }), "{e}");
        handshake(config, &c2).unwrap();
    }

    #[test]
    fn missing_and_empty_files_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = pair(dir.path(), "server");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        for (c, k, named) in [
            (dir.path().join("nope.pem"), key.clone(), "nope.pem"),
            (empty.clone(), key.clone(), "empty.pem"),
            (cert.clone(), empty, "empty.pem"),
        ] {
            let e = ServerCert::load(&c, &k).unwrap_err().to_string();
            assert!(e.contains(named), "{e}");
        }
        let (config, n) = client_config(&certificates(&cert).unwrap()).unwrap();
        assert!(n >= 1);
        assert!(config.alpn_protocols.is_empty());
    }
}
