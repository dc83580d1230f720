//! HTTPS on the image server: the certificate and key (PEM) of
//! `[http]tls_cert_file` / `tls_key_file`, reloaded without a restart when
//! either file changes (cert-manager and similar tools rotate them in
//! place or by swapping a symlink).
//!
//! Each handshake first compares the identity of both files (device, inode,
//! size, modification and change times: two `stat` calls) with the one last
//! loaded; a change loads the new pair, and only a pair that loads (the
//! chain parses, the key parses and matches the certificate) replaces the
//! one in use. A bad pair keeps the old one, logs an error and is counted
//! in `http_tls_reloads_total{result="error"}`; it is not tried again until
//! the files change once more (a certificate written before its key loads
//! on the key's write).
//!
//! The files are looked at on a blocking thread, one look at a time and
//! never under a lock: a handshake waits [`LOOK_WAIT`] at most for it, then
//! goes on with the pair in use, so a path whose reads block (a FIFO, a
//! hung network mount) costs one blocking thread, never the runtime's
//! threads (the image server, `/healthz`, the broker, the clean-ups).

use crate::fsutil::FileStamp;
use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a handshake waits for a look at the files before it goes on
/// with the pair in use.
pub const LOOK_WAIT: Duration = Duration::from_secs(2);

/// The lowest TLS version the image server accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MinVersion {
    /// TLS 1.2 and 1.3.
    Tls12,
    /// TLS 1.3 only.
    Tls13,
}

impl MinVersion {
    fn versions(self) -> &'static [&'static rustls::SupportedProtocolVersion] {
        static FROM_TLS12: [&rustls::SupportedProtocolVersion; 2] =
            [&rustls::version::TLS13, &rustls::version::TLS12];
        static ONLY_TLS13: [&rustls::SupportedProtocolVersion; 1] = [&rustls::version::TLS13];
        match self {
            MinVersion::Tls12 => &FROM_TLS12,
            MinVersion::Tls13 => &ONLY_TLS13,
        }
    }
}

/// Where the image server's certificate and key are, and the versions it
/// speaks.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The certificate chain (PEM), leaf first.
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1); never logged.
    pub key: PathBuf,
    /// The lowest version accepted.
    pub min_version: MinVersion,
}

/// Both files as last seen (`None`: one of them could not be read).
type Identity = Option<(FileStamp, FileStamp)>;

struct Current {
    config: Arc<ServerConfig>,
    seen: Identity,
}

/// The image server's TLS set-up, reloaded when its files change.
pub struct Tls {
    files: TlsFiles,
    /// Held only to read or replace the pair in use, never across I/O.
    current: Mutex<Current>,
    /// A look at the files is under way (at most one at a time).
    looking: AtomicBool,
    reloads: Option<prometheus::IntCounterVec>,
}

/// Ends a look at the files, however it ends.
struct Looking<'a>(&'a AtomicBool);

impl Drop for Looking<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("files", &self.files).finish()
    }
}

impl Tls {
    /// Loads `files`; an error (with the file it concerns, never key
    /// material) when they do not make a usable pair. `reloads` counts later
    /// reloads by result (`ok`, `error`).
    pub fn load(
        files: TlsFiles,
        reloads: Option<prometheus::IntCounterVec>,
    ) -> Result<Tls, String> {
        let seen = identity(&files);
        let config = Arc::new(build(&files)?);
        Ok(Tls {
            files,
            current: Mutex::new(Current { config, seen }),
            looking: AtomicBool::new(false),
            reloads,
        })
    }

    /// The set-up for a new handshake: the files' current pair if they
    /// changed and load, else the one in use (also while another look at
    /// the files is under way, or when this one takes over [`LOOK_WAIT`]).
    pub async fn config(self: &Arc<Self>) -> Arc<ServerConfig> {
        if self.looking.swap(true, Ordering::AcqRel) {
            return self.in_use();
        }
        let tls = self.clone();
        let look = tokio::task::spawn_blocking(move || {
            let _done = Looking(&tls.looking);
            tls.look()
        });
        match tokio::time::timeout(LOOK_WAIT, look).await {
            Ok(Ok(config)) => config,
            Ok(Err(_)) => self.in_use(),
            Err(_) => {
                tracing::warn!(
                    cert = %self.files.cert.display(),
                    "the certificate files take more than {}s to read; serving the pair in use",
                    LOOK_WAIT.as_secs()
                );
                self.in_use()
            }
        }
    }

    /// The pair in use.
    fn in_use(&self) -> Arc<ServerConfig> {
        self.lock().config.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Current> {
        self.current.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Looks at the files (on a blocking thread, no lock held while they
    /// are read) and loads a changed pair.
    fn look(&self) -> Arc<ServerConfig> {
        let now = identity(&self.files);
        {
            let mut current = self.lock();
            if now == current.seen {
                return current.config.clone();
            }
            // Seen before the files are read: a change while they are read
            // is a change again at the next handshake.
            current.seen = now;
        }
        let result = match now {
            None => Err("cannot read the certificate or the key file".to_string()),
            Some(_) => build(&self.files),
        };
        match result {
            Ok(config) => {
                let config = Arc::new(config);
                self.lock().config = config.clone();
                tracing::info!(
                    cert = %self.files.cert.display(),
                    "image server certificate reloaded"
                );
                self.count("ok");
                config
            }
            Err(e) => {
                tracing::error!(
                    error = %e,
                    "new image server certificate not loaded; still serving the previous one"
                );
                self.count("error");
                self.in_use()
            }
        }
    }

    fn count(&self, result: &str) {
        if let Some(r) = &self.reloads {
            r.with_label_values(&[result]).inc();
        }
    }
}

fn identity(files: &TlsFiles) -> Identity {
    let stamp = |p: &PathBuf| std::fs::metadata(p).ok().map(|m| FileStamp::of(&m));
    Some((stamp(&files.cert)?, stamp(&files.key)?))
}

/// The rustls server set-up from `files` (HTTP/1.1 only, as the server).
fn build(files: &TlsFiles) -> Result<ServerConfig, String> {
    let cert = files.cert.display();
    let chain = CertificateDer::pem_file_iter(&files.cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("[http]tls_cert_file {cert}: {e}"))?;
    if chain.is_empty() {
        return Err(format!("[http]tls_cert_file {cert}: no PEM certificate"));
    }
    // The key's own error text could quote key material: name the file only.
    let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|_| {
        format!(
            "[http]tls_key_file {}: no readable PEM private key",
            files.key.display()
        )
    })?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(files.min_version.versions())
        .map_err(|e| format!("[http]tls_min_version: {e}"))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| format!("[http]tls_cert_file/tls_key_file: {e}"))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}
