//! HTTP Basic authentication against an Apache htpasswd file of bcrypt
//! entries, as Ironic's JSON-RPC server checks it
//! (`ironic.common.auth_basic`): `user:$2y$...` lines; other digests are
//! refused when the file is read.
//!
//! Cost bounds: a request without credentials, with an unknown user or a
//! malformed header costs no bcrypt at all. A password is verified with
//! bcrypt once; the outcome is remembered under a keyed digest of user,
//! password and entry (HMAC-SHA-256 with a key drawn at start, so the
//! memory holds nothing a reader could test guesses against), so neither
//! a right nor a wrong password costs a second bcrypt. At most
//! [`CONCURRENT_BCRYPT`] verifications run at once, on blocking threads;
//! others wait their turn. The file is read again when its identity
//! (device, inode, size, times) changes, which forgets every outcome.

use crate::fsutil::FileStamp;
use base64::Engine;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// bcrypt verifications running at once.
const CONCURRENT_BCRYPT: usize = 2;

/// Outcomes remembered (right and wrong passwords together).
const REMEMBERED: usize = 1024;

/// Why a request is not let in.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No credentials, an unknown user or a wrong password (`401`).
    Unauthorized(&'static str),
    /// An `Authorization` header that is not readable Basic (`400`).
    BadRequest(&'static str),
    /// The htpasswd file cannot be read (`500`).
    Unreadable(String),
}

/// The users of an htpasswd file, and the outcomes of passwords checked.
pub(crate) struct Htpasswd {
    path: PathBuf,
    key: [u8; 32],
    state: Mutex<State>,
    bcrypt: Arc<tokio::sync::Semaphore>,
    /// bcrypt verifications run (for the tests of the cost bound).
    verified: std::sync::atomic::AtomicUsize,
}

#[derive(Default)]
struct State {
    /// The file's identity when read (`None`: never read).
    seen: Option<FileStamp>,
    /// User to bcrypt hash.
    users: HashMap<String, String>,
    /// Keyed digests of `(user, password, hash)` checked, and the outcome.
    outcomes: HashMap<[u8; 32], bool>,
    order: VecDeque<[u8; 32]>,
}

impl Htpasswd {
    /// Reads `path`; an error naming it when it cannot be read or holds an
    /// entry that is not bcrypt.
    pub(crate) fn open(path: PathBuf) -> Result<Htpasswd, String> {
        let mut key = [0u8; 32];
        key[..16].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
        key[16..].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
        let auth = Htpasswd {
            path,
            key,
            state: Mutex::default(),
            bcrypt: Arc::new(tokio::sync::Semaphore::new(CONCURRENT_BCRYPT)),
            verified: Default::default(),
        };
        auth.refresh()?;
        Ok(auth)
    }

    /// Reads the file again if it changed; keeps the last good users when
    /// the new file does not read (logged).
    fn refresh(&self) -> Result<(), String> {
        let stamp = std::fs::metadata(&self.path)
            .map(|m| FileStamp::of(&m))
            .map_err(|e| format!("{}: {e}", self.path.display()))?;
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.seen.as_ref() == Some(&stamp) {
            return Ok(());
        }
        let first = state.seen.is_none();
        state.seen = Some(stamp);
        match read_users(&self.path) {
            Ok(users) => {
                state.users = users;
                state.outcomes.clear();
                state.order.clear();
                if !first {
                    tracing::info!(file = %self.path.display(), "JSON-RPC htpasswd file read again");
                }
                Ok(())
            }
            Err(e) if first => Err(e),
            Err(e) => {
                tracing::error!(error = %e, "JSON-RPC htpasswd file not read again; the previous users stay");
                Ok(())
            }
        }
    }

    /// Whether the `Authorization` header value lets the request in; the
    /// user when it does.
    pub(crate) async fn check(&self, header: Option<&[u8]>) -> Result<String, Refusal> {
        let header = header.ok_or(Refusal::Unauthorized("Authorization required"))?;
        let (user, password) = credentials(header)?;
        self.refresh().map_err(Refusal::Unreadable)?;
        let (hash, digest) = {
            let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let Some(hash) = state.users.get(&user).cloned() else {
                return Err(Refusal::Unauthorized("Incorrect username or password"));
            };
            let digest = self.digest(&user, &password, &hash);
            match state.outcomes.get(&digest) {
                Some(true) => return Ok(user),
                Some(false) => return Err(Refusal::Unauthorized("Incorrect username or password")),
                None => (hash, digest),
            }
        };
        let right = self.verify(password, hash.clone()).await;
        self.remember(digest, right);
        if right {
            Ok(user)
        } else {
            tracing::info!(%user, "JSON-RPC password does not match");
            Err(Refusal::Unauthorized("Incorrect username or password"))
        }
    }

    /// One bcrypt verification, in turn with the others.
    async fn verify(&self, password: Vec<u8>, hash: String) -> bool {
        let Ok(_turn) = self.bcrypt.clone().acquire_owned().await else {
            return false;
        };
        self.verified
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tokio::task::spawn_blocking(move || bcrypt::verify(&password, &hash).unwrap_or(false))
            .await
            .unwrap_or(false)
    }

    fn remember(&self, digest: [u8; 32], right: bool) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.outcomes.insert(digest, right).is_none() {
            state.order.push_back(digest);
        }
        while state.order.len() > REMEMBERED {
            if let Some(old) = state.order.pop_front() {
                state.outcomes.remove(&old);
            }
        }
    }

    fn digest(&self, user: &str, password: &[u8], hash: &str) -> [u8; 32] {
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.key)
            .expect("HMAC takes a key of any length");
        for part in [user.as_bytes(), password, hash.as_bytes()] {
            mac.update(&(part.len() as u64).to_be_bytes());
            mac.update(part);
        }
        mac.finalize().into_bytes().into()
    }
}

/// The users of an htpasswd file: `user:hash` lines, bcrypt hashes only.
fn read_users(path: &std::path::Path) -> Result<HashMap<String, String>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut users = HashMap::new();
    for line in text.lines().map(str::trim) {
        let Some((user, hash)) = line.split_once(':') else {
            continue;
        };
        if !["$2y$", "$2a$", "$2b$"].iter().any(|p| hash.starts_with(p)) {
            return Err(format!(
                "{}: only bcrypt entries are supported (user {user:?}); make them with htpasswd -B",
                path.display()
            ));
        }
        users.entry(user.to_string()).or_insert(hash.to_string());
    }
    Ok(users)
}

/// The user and password of a `Basic` authorization header value.
fn credentials(value: &[u8]) -> Result<(String, Vec<u8>), Refusal> {
    let unreadable = Refusal::BadRequest("Could not parse Authorization header");
    let value = std::str::from_utf8(value).map_err(|_| unreadable)?.trim();
    let (scheme, token) = value
        .split_once(' ')
        .ok_or(Refusal::BadRequest("Could not parse Authorization header"))?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return Err(Refusal::BadRequest("Unsupported authorization type"));
    }
    let pair = base64::engine::general_purpose::STANDARD
        .decode(token.trim())
        .map_err(|_| Refusal::BadRequest("Could not decode authorization token"))?;
    let colon = pair
        .iter()
        .position(|b| *b == b':')
        .ok_or(Refusal::BadRequest("Could not decode authorization token"))?;
    let user = String::from_utf8(pair[..colon].to_vec())
        .map_err(|_| Refusal::BadRequest("Could not decode authorization token"))?;
    Ok((user, pair[colon + 1..].to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn basic(user: &str, password: &str) -> Vec<u8> {
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        format!("Basic {token}").into_bytes()
    }

    #[tokio::test]
    async fn bcrypt_entries_checked_once_and_reread_on_change() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("htpasswd");
        let hash = bcrypt::hash("s3cret", 4).unwrap();
        std::fs::write(&file, format!("ironic:{hash}\n")).unwrap();
        let auth = Htpasswd::open(file.clone()).unwrap();
        assert_eq!(
            auth.check(Some(&basic("ironic", "s3cret"))).await,
            Ok("ironic".into())
        );
        assert!(matches!(
            auth.check(Some(&basic("ironic", "wrong"))).await,
            Err(Refusal::Unauthorized(_))
        ));
        // Again, right and wrong: no further bcrypt; nor for requests
        // without credentials or of an unknown user.
        for _ in 0..3 {
            assert!(auth.check(Some(&basic("ironic", "s3cret"))).await.is_ok());
            assert!(auth.check(Some(&basic("ironic", "wrong"))).await.is_err());
            assert!(auth.check(Some(&basic("nobody", "x"))).await.is_err());
            assert!(auth.check(None).await.is_err());
        }
        assert_eq!(auth.verified.load(std::sync::atomic::Ordering::Relaxed), 2);
        assert!(matches!(
            auth.check(None).await,
            Err(Refusal::Unauthorized(_))
        ));
        assert!(matches!(
            auth.check(Some(b"Bearer x")).await,
            Err(Refusal::BadRequest(_))
        ));
        // A new password in the file: the old one no longer lets in.
        let hash = bcrypt::hash("n3w", 4).unwrap();
        std::fs::write(&file, format!("ironic:{hash}\nother:{hash}\n")).unwrap();
        let t = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
        std::fs::File::options()
            .write(true)
            .open(&file)
            .unwrap()
            .set_modified(t)
            .unwrap();
        assert!(auth.check(Some(&basic("ironic", "s3cret"))).await.is_err());
        assert_eq!(
            auth.check(Some(&basic("other", "n3w"))).await,
            Ok("other".into())
        );
        std::fs::write(&file, "ironic:{SHA}abc\n").unwrap();
        let refused = Htpasswd::open(file).err().unwrap();
        assert!(refused.contains("only bcrypt"), "{refused}");
    }
}
