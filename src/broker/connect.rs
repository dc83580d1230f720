//! Reaching a broker: the URLs of `[amqp]url` tried in turn, the heartbeat
//! asked of the broker, and TLS from the worker's own options (CA file,
//! client certificate and key, hostname verification, TLS version).
//!
//! TLS material is read once at start-up, so a missing or unreadable file
//! stops the worker with a clear message instead of failing every
//! reconnect. Nothing here logs a password or key.

use crate::config::{AmqpSection, SslVersion};
use crate::error::{Error, ErrorCode, Result};
use crate::secrets::redact_url;
use lapin::tcp::{AsyncTcpStream, RustlsConnector};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Connection, ConnectionProperties};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use std::sync::Arc;

/// The brokers to try, in order, and how to speak TLS to them.
pub struct Brokers {
    uris: Vec<AMQPUri>,
    names: Vec<String>,
    tls: Option<Arc<RustlsConnector>>,
}

impl Brokers {
    /// Parses `[amqp]url` and loads the TLS files. Errors name the option
    /// and the file, never a secret.
    pub fn new(a: &AmqpSection) -> Result<Brokers> {
        let mut uris = Vec::new();
        let mut names = Vec::new();
        for url in &a.url {
            let mut uri: AMQPUri = url.parse().map_err(|e| {
                Error::new(
                    ErrorCode::Internal,
                    format!("[amqp]url {}: {e}", redact_url(url)),
                )
            })?;
            if uri.query.heartbeat.is_none() && a.heartbeat > 0 {
                uri.query.heartbeat = Some(a.heartbeat);
            }
            names.push(redact_url(url));
            uris.push(uri);
        }
        if uris.is_empty() {
            return Err(Error::new(ErrorCode::Internal, "[amqp]url: no broker URL"));
        }
        let tls = if uris.iter().any(|u| u.scheme == AMQPScheme::AMQPS) {
            Some(Arc::new(tls_connector(a).map_err(|e| {
                Error::new(ErrorCode::Internal, format!("[amqp] TLS options: {e}"))
            })?))
        } else {
            if !(a.ssl_ca_file.is_empty() && a.ssl_cert_file.is_empty()) {
                tracing::warn!("[amqp]ssl_* options are set but no URL is amqps://: TLS is off");
            }
            None
        };
        Ok(Brokers { uris, names, tls })
    }

    /// How many brokers the list holds.
    pub fn len(&self) -> usize {
        self.uris.len()
    }

    /// Broker `index` as logs show it (password masked).
    pub fn name(&self, index: usize) -> &str {
        &self.names[index % self.names.len()]
    }

    /// Opens an AMQP connection to broker `index` (plain or TLS by scheme).
    pub async fn connect(
        &self,
        index: usize,
        props: ConnectionProperties,
    ) -> lapin::Result<Connection> {
        let uri = self.uris[index % self.uris.len()].clone();
        let runtime = lapin::runtime::default_runtime()?;
        let tls = self.tls.clone();
        Connection::connector(
            uri,
            runtime,
            async move |uri: AMQPUri, runtime| {
                let host = uri.authority.host.clone();
                let addrs: Vec<std::net::SocketAddr> =
                    tokio::net::lookup_host((host.as_str(), uri.authority.port))
                        .await?
                        .collect();
                let stream = AsyncTcpStream::connect(&runtime, addrs).await?;
                match (uri.scheme, &tls) {
                    (AMQPScheme::AMQPS, Some(tls)) => Ok(stream.into_rustls(tls, &host).await?),
                    (AMQPScheme::AMQPS, None) => {
                        Err(std::io::Error::other("TLS not set up").into())
                    }
                    (AMQPScheme::AMQP, _) => Ok(stream),
                }
            },
            props,
        )
        .await
    }
}

/// The rustls client set-up from `[amqp]ssl_*`.
fn tls_connector(a: &AmqpSection) -> std::result::Result<RustlsConnector, String> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let versions: &[&rustls::SupportedProtocolVersion] = match a.ssl_version {
        SslVersion::Tls12 => &[&rustls::version::TLS12],
        SslVersion::Tls13 => &[&rustls::version::TLS13],
        SslVersion::Any => rustls::ALL_VERSIONS,
    };
    let verifier: Arc<dyn ServerCertVerifier> = if a.ssl_ca_file.is_empty() {
        Arc::new(
            rustls_platform_verifier::Verifier::new(provider.clone())
                .map_err(|e| format!("system trust store: {e}"))?,
        )
    } else {
        let mut roots = RootCertStore::empty();
        let certs = CertificateDer::pem_file_iter(&a.ssl_ca_file)
            .map_err(|e| format!("ssl_ca_file {}: {e}", a.ssl_ca_file))?;
        for cert in certs {
            let cert = cert.map_err(|e| format!("ssl_ca_file {}: {e}", a.ssl_ca_file))?;
            roots
                .add(cert)
                .map_err(|e| format!("ssl_ca_file {}: {e}", a.ssl_ca_file))?;
        }
        if roots.is_empty() {
            return Err(format!("ssl_ca_file {}: no certificate", a.ssl_ca_file));
        }
        rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        )
        .build()
        .map_err(|e| format!("ssl_ca_file {}: {e}", a.ssl_ca_file))?
    };
    let verifier = if a.ssl_verify_hostname {
        verifier
    } else {
        Arc::new(AnyHostName(verifier))
    };
    let builder = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .map_err(|e| format!("ssl_version: {e}"))?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let config = if a.ssl_cert_file.is_empty() {
        builder.with_no_client_auth()
    } else {
        let chain = CertificateDer::pem_file_iter(&a.ssl_cert_file)
            .and_then(|certs| certs.collect::<std::result::Result<Vec<_>, _>>())
            .map_err(|e| format!("ssl_cert_file {}: {e}", a.ssl_cert_file))?;
        // The key's own error text could quote key material: name the file only.
        let key = PrivateKeyDer::from_pem_file(&a.ssl_key_file).map_err(|_| {
            format!(
                "ssl_key_file {}: no readable PEM private key",
                a.ssl_key_file
            )
        })?;
        builder
            .with_client_auth_cert(chain, key)
            .map_err(|e| format!("ssl_cert_file/ssl_key_file: {e}"))?
    };
    Ok(RustlsConnector::from(Arc::new(config)))
}

/// Verifies the broker's certificate chain but accepts any host name in it
/// (`[amqp]ssl_verify_hostname = false`, for brokers reached by an address
/// their certificate does not list).
#[derive(Debug)]
struct AnyHostName(Arc<dyn ServerCertVerifier>);

impl ServerCertVerifier for AnyHostName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
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
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}
