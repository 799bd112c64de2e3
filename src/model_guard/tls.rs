//! The TLS config of the guard's client: rustls with aws-lc-rs as its explicit crypto
//! provider (nothing process-wide is installed), TLS 1.2 and 1.3, the compiled-in Mozilla
//! root store plus the extra CAs of [`super::ModelGuardConfig`], HTTP/1.1 by ALPN.

use std::sync::Arc;

use rustls::RootCertStore;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;

use super::GuardError;

/// Builds the client config; each extra PEM must hold at least one certificate.
pub(crate) fn client_config(extra_pem: &[Vec<u8>]) -> Result<rustls::ClientConfig, GuardError> {
    let mut roots = RootCertStore::from_iter(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    for (i, pem) in extra_pem.iter().enumerate() {
        let mut found = 0;
        for cert in CertificateDer::pem_slice_iter(pem) {
            let cert = cert.map_err(|e| GuardError::Certificate(format!("entry {i}: {e}")))?;
            roots
                .add(cert)
                .map_err(|e| GuardError::Certificate(format!("entry {i}: {e}")))?;
            found += 1;
        }
        if found == 0 {
            return Err(GuardError::Certificate(format!(
                "entry {i} holds no certificate"
            )));
        }
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| GuardError::Certificate(format!("TLS setup: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}
