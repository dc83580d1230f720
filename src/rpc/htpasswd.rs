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
//! a right nor a wrong password costs a second bcrypt. Right and wrong
//! outcomes are remembered apart ([`REMEMBERED_RIGHT`],
//! [`REMEMBERED_WRONG`]): however many wrong passwords are tried, a right
//! one is never forgotten for them. At most [`CONCURRENT_BCRYPT`]
//! verifications run at once, on blocking threads, in turn. Fairness
//! between clients: one client address (an IPv6 client's /64) may have at
//! most [`PENDING_PER_CLIENT`] verifications waiting or running; beyond
//! them it is refused at once ([`Refusal::Busy`], `429`), so a client
//! trying many wrong passwords delays another's first call by at most
//! that many verifications. Requests with the same credentials share one
//! verification (and count once). The file is read again when its
//! identity (device, inode, size, times) changes, which forgets every
//! outcome.

use crate::fsutil::FileStamp;
use base64::Engine;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use std::collections::{HashMap, HashSet, VecDeque};
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::sync::OnceCell;

/// bcrypt verifications running at once.
const CONCURRENT_BCRYPT: usize = 2;

/// bcrypt verifications one client address may have waiting or running.
pub(crate) const PENDING_PER_CLIENT: usize = 2;

/// Right passwords remembered (only someone who knows one adds one).
pub(crate) const REMEMBERED_RIGHT: usize = 64;

/// Wrong passwords remembered (anyone adds them: they never push out a
/// right one).
pub(crate) const REMEMBERED_WRONG: usize = 1024;

/// Why a request is not let in.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No credentials, an unknown user or a wrong password (`401`).
    Unauthorized(&'static str),
    /// An `Authorization` header that is not readable Basic (`400`).
    BadRequest(&'static str),
    /// Its client already has [`PENDING_PER_CLIENT`] passwords being
    /// verified (`429`, to be tried again a moment later).
    Busy,
    /// The htpasswd file cannot be read (`500`).
    Unreadable(String),
}

/// A keyed digest of `(user, password, hash)`.
type Digest = [u8; 32];

/// One verification under way, shared by every request with the same
/// credentials.
type Flight = Arc<OnceCell<bool>>;

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
    /// Digests of right passwords, and of wrong ones.
    right: Remembered,
    wrong: Remembered,
    /// Verifications under way, by digest.
    flights: HashMap<Digest, Flight>,
    /// Verifications under way per client (see [`Client`]).
    pending: HashMap<Client, usize>,
}

/// Digests remembered, the oldest forgotten first beyond a bound.
#[derive(Default)]
struct Remembered {
    known: HashSet<Digest>,
    order: VecDeque<Digest>,
}

impl Remembered {
    fn contains(&self, digest: &Digest) -> bool {
        self.known.contains(digest)
    }

    fn insert(&mut self, digest: Digest, bound: usize) {
        if self.known.insert(digest) {
            self.order.push_back(digest);
        }
        while self.order.len() > bound {
            if let Some(old) = self.order.pop_front() {
                self.known.remove(&old);
            }
        }
    }

    fn clear(&mut self) {
        self.known.clear();
        self.order.clear();
    }
}

/// Who the per-client bound counts a verification against: an IPv4
/// address, or an IPv6 client's /64 (one host commonly has a whole /64);
/// `None` when the connection's address is unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Client(Option<IpAddr>);

impl Client {
    fn of(addr: Option<IpAddr>) -> Client {
        Client(addr.map(|a| match a.to_canonical() {
            IpAddr::V6(v6) => {
                let prefix = u128::from(v6) & !((1u128 << 64) - 1);
                IpAddr::V6(prefix.into())
            }
            v4 => v4,
        }))
    }
}

/// A verification this request started: counted against its client until
/// dropped (answered or abandoned), and no longer shared once over.
struct Started<'a> {
    auth: &'a Htpasswd,
    client: Client,
    digest: Digest,
    flight: Flight,
}

impl Drop for Started<'_> {
    fn drop(&mut self) {
        let mut state = self.auth.lock();
        if let Some(n) = state.pending.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                state.pending.remove(&self.client);
            }
        }
        if state
            .flights
            .get(&self.digest)
            .is_some_and(|f| Arc::ptr_eq(f, &self.flight))
        {
            state.flights.remove(&self.digest);
        }
    }
}

/// What is known of a password before any bcrypt.
enum Known<'a> {
    /// Remembered right, or wrong.
    Outcome(bool),
    /// To be verified (or being verified for another request): by this
    /// request when `started` holds its count.
    Verify {
        hash: String,
        digest: Digest,
        flight: Flight,
        started: Option<Started<'a>>,
    },
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

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the file again if it changed; keeps the last good users when
    /// the new file does not read (logged).
    fn refresh(&self) -> Result<(), String> {
        let stamp = std::fs::metadata(&self.path)
            .map(|m| FileStamp::of(&m))
            .map_err(|e| format!("{}: {e}", self.path.display()))?;
        let mut state = self.lock();
        if state.seen.as_ref() == Some(&stamp) {
            return Ok(());
        }
        let first = state.seen.is_none();
        state.seen = Some(stamp);
        match read_users(&self.path) {
            Ok(users) => {
                state.users = users;
                state.right.clear();
                state.wrong.clear();
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

    /// Whether the `Authorization` header value of a request from `client`
    /// lets the request in; the user when it does.
    pub(crate) async fn check(
        &self,
        header: Option<&[u8]>,
        client: Option<IpAddr>,
    ) -> Result<String, Refusal> {
        let header = header.ok_or(Refusal::Unauthorized("Authorization required"))?;
        let (user, password) = credentials(header)?;
        self.refresh().map_err(Refusal::Unreadable)?;
        let right = match self.look_up(&user, &password, Client::of(client))? {
            Known::Outcome(right) => right,
            Known::Verify {
                hash,
                digest,
                flight,
                started,
            } => {
                let right = *flight.get_or_init(|| self.verify(password, hash)).await;
                self.remember(digest, right);
                // Logged once per password, by the request that started
                // its verification.
                if !right && started.is_some() {
                    tracing::info!(%user, "JSON-RPC password does not match");
                }
                drop(started);
                right
            }
        };
        if right {
            Ok(user)
        } else {
            Err(Refusal::Unauthorized("Incorrect username or password"))
        }
    }

    /// The remembered outcome of `password`, else the verification to wait
    /// for: joined when one is under way, else started and counted against
    /// `client` ([`Refusal::Busy`] when it has its share under way).
    fn look_up(&self, user: &str, password: &[u8], client: Client) -> Result<Known<'_>, Refusal> {
        let mut state = self.lock();
        let Some(hash) = state.users.get(user).cloned() else {
            return Err(Refusal::Unauthorized("Incorrect username or password"));
        };
        let digest = self.digest(user, password, &hash);
        if state.right.contains(&digest) {
            return Ok(Known::Outcome(true));
        }
        if state.wrong.contains(&digest) {
            return Ok(Known::Outcome(false));
        }
        if let Some(flight) = state.flights.get(&digest) {
            let flight = flight.clone();
            return Ok(Known::Verify {
                hash,
                digest,
                flight,
                started: None,
            });
        }
        let pending = state.pending.entry(client).or_default();
        if *pending >= PENDING_PER_CLIENT {
            tracing::debug!(client = ?client.0, "JSON-RPC password checks of this client at their bound: refused");
            return Err(Refusal::Busy);
        }
        *pending += 1;
        let flight = Flight::default();
        state.flights.insert(digest, flight.clone());
        let started = Started {
            auth: self,
            client,
            digest,
            flight: flight.clone(),
        };
        Ok(Known::Verify {
            hash,
            digest,
            flight,
            started: Some(started),
        })
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

    fn remember(&self, digest: Digest, right: bool) {
        let mut state = self.lock();
        if right {
            state.right.insert(digest, REMEMBERED_RIGHT);
        } else {
            state.wrong.insert(digest, REMEMBERED_WRONG);
        }
    }

    fn digest(&self, user: &str, password: &[u8], hash: &str) -> Digest {
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
            auth.check(Some(&basic("ironic", "s3cret")), None).await,
            Ok("ironic".into())
        );
        assert!(matches!(
            auth.check(Some(&basic("ironic", "wrong")), None).await,
            Err(Refusal::Unauthorized(_))
        ));
        // Again, right and wrong: no further bcrypt; nor for requests
        // without credentials or of an unknown user.
        for _ in 0..3 {
            assert!(
                auth.check(Some(&basic("ironic", "s3cret")), None)
                    .await
                    .is_ok()
            );
            assert!(
                auth.check(Some(&basic("ironic", "wrong")), None)
                    .await
                    .is_err()
            );
            assert!(auth.check(Some(&basic("nobody", "x")), None).await.is_err());
            assert!(auth.check(None, None).await.is_err());
        }
        assert_eq!(auth.verified.load(std::sync::atomic::Ordering::Relaxed), 2);
        assert!(matches!(
            auth.check(None, None).await,
            Err(Refusal::Unauthorized(_))
        ));
        assert!(matches!(
            auth.check(Some(b"Bearer x"), None).await,
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
        assert!(
            auth.check(Some(&basic("ironic", "s3cret")), None)
                .await
                .is_err()
        );
        assert_eq!(
            auth.check(Some(&basic("other", "n3w")), None).await,
            Ok("other".into())
        );
        std::fs::write(&file, "ironic:{SHA}abc\n").unwrap();
        let refused = Htpasswd::open(file).err().unwrap();
        assert!(refused.contains("only bcrypt"), "{refused}");
    }

    fn verified(auth: &Htpasswd) -> usize {
        auth.verified.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn auth_of(dir: &tempfile::TempDir, password: &str) -> Arc<Htpasswd> {
        let file = dir.path().join("htpasswd");
        let hash = bcrypt::hash(password, 4).unwrap();
        std::fs::write(&file, format!("ironic:{hash}\n")).unwrap();
        Arc::new(Htpasswd::open(file).unwrap())
    }

    /// Forty requests of one address with a wrong password each, then a
    /// genuine one of another address: the excess of the first is refused
    /// at once, and the genuine one waits for no more verifications than
    /// the first address may have under way (counted, not timed: every
    /// request is polled once, in order, before any verification ends).
    #[tokio::test]
    async fn wrong_passwords_of_one_client_do_not_delay_another() {
        let dir = tempfile::tempdir().unwrap();
        let auth = auth_of(&dir, "s3cret");
        let attacker: IpAddr = "192.0.2.66".parse().unwrap();
        let mut refused_at_once = 0;
        let mut pending = Vec::new();
        for i in 0..40 {
            let a = auth.clone();
            let mut guess = Box::pin(async move {
                a.check(Some(&basic("ironic", &format!("guess{i}"))), Some(attacker))
                    .await
            });
            match futures_util::poll!(guess.as_mut()) {
                std::task::Poll::Ready(Err(Refusal::Busy)) => refused_at_once += 1,
                std::task::Poll::Ready(other) => panic!("answered at once: {other:?}"),
                std::task::Poll::Pending => pending.push(tokio::spawn(guess)),
            }
        }
        let genuine = basic("ironic", "s3cret");
        let genuine = auth.check(Some(&genuine), Some("192.0.2.1".parse().unwrap()));
        assert_eq!(genuine.await, Ok("ironic".into()));
        let before_genuine = verified(&auth);
        assert!(
            before_genuine <= PENDING_PER_CLIENT + 1,
            "{before_genuine} verifications ran before the genuine one was answered"
        );
        assert_eq!(refused_at_once, 40 - PENDING_PER_CLIENT);
        for guess in pending {
            assert!(matches!(
                guess.await.unwrap(),
                Err(Refusal::Unauthorized(_))
            ));
        }
        // Under way no more: the address may try again.
        assert!(matches!(
            auth.check(Some(&basic("ironic", "guess0")), Some(attacker))
                .await,
            Err(Refusal::Unauthorized(_))
        ));
    }

    /// A right password stays remembered however many wrong ones follow it.
    #[tokio::test]
    async fn a_right_password_is_not_forgotten_for_wrong_ones() {
        let dir = tempfile::tempdir().unwrap();
        let auth = auth_of(&dir, "s3cret");
        assert!(
            auth.check(Some(&basic("ironic", "s3cret")), None)
                .await
                .is_ok()
        );
        for i in 0..REMEMBERED_WRONG + 8 {
            let wrong = basic("ironic", &format!("guess{i}"));
            assert!(auth.check(Some(&wrong), None).await.is_err());
        }
        let before = verified(&auth);
        assert!(
            auth.check(Some(&basic("ironic", "s3cret")), None)
                .await
                .is_ok()
        );
        assert_eq!(
            verified(&auth),
            before,
            "the right password was verified again"
        );
    }

    /// Requests with the same credentials at once share one verification,
    /// and do not count against their client's bound one by one.
    #[tokio::test]
    async fn the_same_credentials_at_once_share_one_verification() {
        let dir = tempfile::tempdir().unwrap();
        let auth = auth_of(&dir, "s3cret");
        let client = Some("192.0.2.1".parse().unwrap());
        let header = basic("ironic", "s3cret");
        let calls = (0..10).map(|_| auth.check(Some(&header), client));
        for answer in futures_util::future::join_all(calls).await {
            assert_eq!(answer, Ok("ironic".into()));
        }
        assert_eq!(verified(&auth), 1);
    }

    #[test]
    fn an_ipv6_client_is_its_64() {
        let a = Client::of(Some("2001:db8:1:2:3:4:5:6".parse().unwrap()));
        let b = Client::of(Some("2001:db8:1:2:ffff::1".parse().unwrap()));
        let c = Client::of(Some("2001:db8:1:3::1".parse().unwrap()));
        assert_eq!(a, b);
        assert_ne!(a, c);
        let mapped = Client::of(Some("::ffff:192.0.2.1".parse().unwrap()));
        assert_eq!(mapped, Client::of(Some("192.0.2.1".parse().unwrap())));
    }
}
