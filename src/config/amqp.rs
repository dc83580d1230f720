//! `[amqp]`: the worker's broker: the URLs of a cluster, TLS, heartbeats,
//! and the names and kinds of its exchanges and queues.

use super::check::Report;
use super::choice::choice;
use super::layers::InterfaceSeal;
use super::value::OneOrMany;
use crate::seal::{Keys, Sealer};
use crate::secrets::redact_url_list;
use serde::{Deserialize, Deserializer, Serialize, de};

/// `[amqp]`: the worker's broker settings.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct AmqpSection {
    /// Whether the worker uses a broker at all. `false`: no connection,
    /// no command queue, no notifications, no peers; commands come through
    /// the JSON-RPC listener (`[json_rpc]`).
    pub enabled: bool,
    /// Broker URLs (`amqp://` or `amqps://`), one per node of a cluster:
    /// each reconnect tries the next one. A TOML array, or one string with
    /// comma-separated URLs or hosts as in oslo.messaging's `transport_url`
    /// (`amqp://u:p@h1:5672,u:p@h2:5672/vhost`). Never logged with a password.
    #[serde(deserialize_with = "url_list")]
    pub url: Vec<String>,
    /// Heartbeat interval asked of the broker, seconds (0 = the broker's
    /// choice). A connection silent for two intervals is declared dead, so a
    /// hung or paused broker node is left within about twice this.
    pub heartbeat: u16,
    /// Seconds allowed to connect (TCP, TLS, AMQP handshake) and declare the
    /// topology before the next broker is tried.
    pub connect_timeout: u64,
    /// CA certificates (PEM) that sign the brokers' certificates; empty =
    /// the system trust store (oslo.messaging's `ssl_ca_file`).
    pub ssl_ca_file: String,
    /// Client certificate (PEM) for brokers that require one.
    pub ssl_cert_file: String,
    /// Private key (PEM, PKCS#8/PKCS#1/SEC1) of `ssl_cert_file`; never logged.
    pub ssl_key_file: String,
    /// Whether the broker certificate must name the host of the URL (the
    /// chain is always verified).
    pub ssl_verify_hostname: bool,
    /// oslo.messaging's `ssl_version`: `TLSv1_2` or `TLSv1_3` pins that
    /// version; empty (or `SSLv23`/`TLS`) allows TLS 1.2 and 1.3. Older
    /// versions are refused.
    pub ssl_version: SslVersion,
    /// The broker's `consumer_timeout` in seconds (RabbitMQ's default 1800;
    /// 0 = none): work still running after three quarters of it is
    /// acknowledged early, so the broker neither closes the channel nor
    /// redelivers it, and it is answered when done.
    pub consumer_timeout: u64,
    /// Command exchange (topic).
    pub command_exchange: String,
    /// Prefix of the per-host command queue (`<prefix>.<host>`).
    pub queue_prefix: String,
    /// Dead-letter exchange.
    pub dead_letter_exchange: String,
    /// Exchange for completion events without `reply_to`.
    pub events_exchange: String,
    /// `quorum` or `classic`.
    pub queue_type: QueueType,
    /// Redeliveries allowed before a quorum queue dead-letters a message.
    pub delivery_limit: u32,
    /// Messages handled at once (AMQP prefetch).
    pub prefetch: u16,
    /// Whether to bind the per-host queue to Ironic's notification exchange
    /// (unset: yes, with a broker).
    pub bind_notifications: Option<bool>,
    /// Ironic's notification exchange (`[DEFAULT]control_exchange`).
    pub notification_exchange: String,
    /// Notification topics (routing keys get `.info` / `.error` appended).
    #[serde(deserialize_with = "super::value::list_opt")]
    pub notification_topics: Vec<String>,
    /// Durability used when the worker has to create Ironic's exchange
    /// itself (oslo.messaging's `amqp_durable_queues`, default false); an
    /// existing exchange is used as it is.
    pub notification_exchange_durable: bool,
    /// Seconds to wait for in-flight work on shutdown before requeueing it.
    pub shutdown_grace: u64,
    /// Largest message body read, bytes: a longer one is answered
    /// `invalid_message` and dead-lettered unread, so one message costs
    /// the worker memory of its own size at most. Commands are a few KiB;
    /// Ironic's notifications carry the node's `instance_info`, a
    /// configdrive included during a deploy.
    pub max_message_bytes: usize,
    /// The seal keys shared with the deploy interface (its
    /// `[image_worker]seal_secret_file`): one hex key a line, at least 32
    /// bytes, the current one first, an optional previous one second; mode
    /// 0600 or 0640. Empty: commands and answers are not sealed.
    pub seal_secret_file: String,
    /// `off`, `send` (seal answers, take unsealed commands: a rolling
    /// upgrade) or `require` (refuse commands not sealed with a known
    /// key). Unset: `require` with `seal_secret_file`, else `off`.
    pub seal: Option<SealMode>,
}

choice! {
    /// `[amqp]seal`: whether answers are sealed and unsealed commands
    /// refused.
    pub enum SealMode refused as "{value:?}: off, send or require" {
        /// Nothing sealed, no seal checked.
        Off = "off",
        /// Answers sealed; unsealed commands taken, wrongly sealed ones refused.
        Send = "send",
        /// Answers sealed; only commands sealed with a known key taken.
        Require = "require",
    }
}

choice! {
    /// `[amqp]ssl_version`: the TLS versions spoken to the brokers, with
    /// oslo.messaging's names (and `TLSv1.2`/`TLSv1.3`); older versions
    /// are refused.
    pub enum SslVersion refused as "{value:?}: only TLSv1_2 and TLSv1_3 are supported (empty allows both)" {
        /// TLS 1.2 and 1.3.
        Any = "" | "SSLv23" | "TLS" | "PROTOCOL_TLS",
        /// TLS 1.2 only.
        Tls12 = "TLSv1_2" | "TLSv1.2",
        /// TLS 1.3 only.
        Tls13 = "TLSv1_3" | "TLSv1.3",
    }
}

choice! {
    /// `[amqp]queue_type`: the kind of the queues the worker declares, as
    /// RabbitMQ's `x-queue-type` names it.
    pub enum QueueType refused as "unknown value {value:?} (quorum or classic)" {
        /// Replicated, with a delivery limit.
        Quorum = "quorum",
        /// A classic queue (no delivery limit).
        Classic = "classic",
    }
}

impl Default for AmqpSection {
    fn default() -> Self {
        AmqpSection {
            enabled: true,
            url: vec!["amqp://guest:guest@127.0.0.1:5672/%2f".into()],
            heartbeat: 10,
            connect_timeout: 10,
            ssl_ca_file: String::new(),
            ssl_cert_file: String::new(),
            ssl_key_file: String::new(),
            ssl_verify_hostname: true,
            ssl_version: SslVersion::Any,
            consumer_timeout: 1800,
            command_exchange: "ironic-image-worker".into(),
            queue_prefix: "ironic-image-worker".into(),
            dead_letter_exchange: "ironic-image-worker.dlx".into(),
            events_exchange: "ironic-image-worker.events".into(),
            queue_type: QueueType::Quorum,
            delivery_limit: 5,
            prefetch: 32,
            bind_notifications: None,
            notification_exchange: "ironic".into(),
            notification_topics: vec!["ironic_versioned_notifications".into()],
            notification_exchange_durable: false,
            shutdown_grace: 30,
            max_message_bytes: 4 << 20,
            seal_secret_file: String::new(),
            seal: None,
        }
    }
}

impl AmqpSection {
    /// Whether the per-host queue is bound to Ironic's notifications: as
    /// `bind_notifications` says, and by default whenever there is a broker.
    pub fn binds_notifications(&self) -> bool {
        self.enabled && self.bind_notifications.unwrap_or(true)
    }

    /// The seal mode in force: `seal`, else `require` with a key file and
    /// `off` without.
    pub fn seal_mode(&self) -> SealMode {
        match (self.seal, self.seal_secret_file.is_empty()) {
            (Some(mode), _) => mode,
            (None, false) => SealMode::Require,
            (None, true) => SealMode::Off,
        }
    }

    /// The seal policy in force, its keys read (`None`: `off`).
    pub(crate) fn sealer(&self) -> crate::error::Result<Option<Sealer>> {
        self.read_sealer()
            .map_err(|(option, why)| super::check::config_error(format!("[amqp]{option}: {why}")))
    }

    /// [`AmqpSection::sealer`], or the option at fault and why.
    fn read_sealer(&self) -> Result<Option<Sealer>, (&'static str, String)> {
        let require = match self.seal_mode() {
            SealMode::Off => return Ok(None),
            SealMode::Send => false,
            SealMode::Require => true,
        };
        if self.seal_secret_file.is_empty() {
            let mode = self.seal_mode();
            return Err(("seal", format!("{mode} needs [amqp]seal_secret_file")));
        }
        let keys = Keys::read(std::path::Path::new(&self.seal_secret_file))
            .map_err(|why| ("seal_secret_file", why))?;
        Ok(Some(Sealer { keys, require }))
    }

    /// The broker URLs with their passwords masked, for logs.
    pub fn url_redacted(&self) -> String {
        self.url
            .iter()
            .map(|u| redact_url_list(u))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Every broker URL parses, the TLS options name readable files and
    /// the limits are limits to the broker.
    pub(super) fn check(&self, report: &mut Report) {
        self.check_urls(report);
        self.check_tls(report);
        if let Err((option, why)) = self.read_sealer() {
            report.error("amqp", option, why);
        }
        if self.prefetch == 0 {
            report.error(
                "amqp",
                "prefetch",
                "must be at least 1 (0 means unlimited to the broker)",
            );
        }
        if i32::try_from(self.delivery_limit).is_err() {
            report.error(
                "amqp",
                "delivery_limit",
                format!(
                    "{} is too large (at most {})",
                    self.delivery_limit,
                    i32::MAX
                ),
            );
        }
    }

    /// Names a deployment where the worker and its deploy interface
    /// (`interface`, from the ironic.conf read) disagree on the seal: an
    /// error when every command (the worker requires seals the interface
    /// does not make) or every answer (the reverse) would be refused, or
    /// when both hold keys and none is common; a warning while one side
    /// only sends seals (a rolling upgrade).
    pub(super) fn check_seal_matches(&self, interface: &InterfaceSeal, report: &mut Report) {
        if !interface.over_broker {
            return;
        }
        let (ours, theirs) = (self.seal_mode(), interface.mode());
        let at = &interface.source;
        let problem = match (ours, theirs) {
            (SealMode::Require, "off") => Some((
                true,
                format!(
                    "the deploy interface seals no command ({at} is not set): every command would be \
                 refused; set it to the same key file, or [amqp]seal = send during an upgrade"
                ),
            )),
            (SealMode::Off, "require") => Some((
                true,
                format!(
                    "not set, but the deploy interface requires sealed answers ({at}): every answer \
                 would be refused; set it to the same key file"
                ),
            )),
            (SealMode::Send, "off") | (SealMode::Off, "send") => Some((
                false,
                format!(
                    "one side seals and the other does not ([amqp]seal = {ours}, the deploy \
                 interface's {theirs}, {at}): fine during an upgrade, require on both sides after"
                ),
            )),
            _ => None,
        };
        match problem {
            Some((true, why)) => report.error("amqp", "seal_secret_file", why),
            Some((false, why)) => report.warn("amqp", "seal", why),
            None => self.check_common_key(interface, report),
        }
    }

    /// Both sides hold keys: when the worker may read the interface's key
    /// file, they must share a key.
    fn check_common_key(&self, interface: &InterfaceSeal, report: &mut Report) {
        let Some(path) = &interface.secret_file else {
            return;
        };
        let (Ok(Some(ours)), Ok(theirs)) = (self.read_sealer(), Keys::read(path.as_ref())) else {
            return;
        };
        if !ours.keys.shares_a_key_with(&theirs) {
            report.error(
                "amqp",
                "seal_secret_file",
                format!(
                    "shares no key with the deploy interface's {path} ({}): every command and \
                     answer would be refused",
                    interface.source
                ),
            );
        }
    }

    fn check_urls(&self, report: &mut Report) {
        if self.url.is_empty() {
            report.error("amqp", "url", "no broker URL");
        }
        for (i, url) in self.url.iter().enumerate() {
            if let Err(e) = url.parse::<lapin::uri::AMQPUri>() {
                report.error(
                    "amqp",
                    "url",
                    format!(
                        "#{} {}: {e}",
                        i + 1,
                        crate::secrets::redact_unreadable_url(url)
                    ),
                );
            } else if !(url.starts_with("amqp://") || url.starts_with("amqps://")) {
                report.error(
                    "amqp",
                    "url",
                    format!(
                        "#{} {}: the scheme must be amqp:// or amqps://",
                        i + 1,
                        redact_url_list(url)
                    ),
                );
            }
        }
    }

    fn check_tls(&self, report: &mut Report) {
        if self.ssl_cert_file.is_empty() != self.ssl_key_file.is_empty() {
            let set = match self.ssl_cert_file.is_empty() {
                true => "ssl_key_file",
                false => "ssl_cert_file",
            };
            report.error("amqp", set, "ssl_cert_file and ssl_key_file go together");
        }
        for (name, path) in [
            ("ssl_ca_file", &self.ssl_ca_file),
            ("ssl_cert_file", &self.ssl_cert_file),
            ("ssl_key_file", &self.ssl_key_file),
        ] {
            if !path.is_empty()
                && let Err(e) = std::fs::metadata(path)
            {
                report.error("amqp", name, format!("{path}: {e}"));
            }
        }
    }
}

/// Splits one `[amqp]url` string into broker URLs: `URL,URL,...` (each with
/// its scheme), or oslo.messaging's multi-host form
/// `scheme://[user:pass@]host[:port],[user:pass@]host[:port]/vhost?query`,
/// where every host gets the scheme, virtual host and query. Errors never
/// show a password.
pub fn split_broker_urls(value: &str) -> std::result::Result<Vec<String>, String> {
    let value = value.trim();
    if !value.contains(',') {
        return Ok(vec![value.to_string()]);
    }
    let pieces: Vec<&str> = value.split(',').map(str::trim).collect();
    if pieces.iter().all(|p| p.contains("://")) {
        return Ok(pieces.into_iter().map(str::to_string).collect());
    }
    let Some((scheme, rest)) = value.split_once("://") else {
        return Err(format!(
            "{}: a list must start with a scheme (amqp:// or amqps://)",
            redact_url_list(value)
        ));
    };
    let (authority, tail) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    if authority.contains("://") || tail.contains(',') {
        return Err(format!(
            "{}: mixes full URLs and bare hosts; write a list of full URLs",
            redact_url_list(value)
        ));
    }
    authority
        .split(',')
        .map(|host| {
            let host = host.trim();
            if host.is_empty() {
                Err(format!("{}: an empty host", redact_url_list(value)))
            } else {
                Ok(format!("{scheme}://{host}{tail}"))
            }
        })
        .collect()
}

/// `[amqp]url`: a TOML array of URLs, or one string holding a
/// comma-separated list (see [`split_broker_urls`]).
fn url_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    let items = match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => vec![s],
        OneOrMany::Many(v) => v,
    };
    let mut out = Vec::new();
    for item in items {
        out.extend(split_broker_urls(&item).map_err(de::Error::custom)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::choice::refusal;
    use super::{QueueType, SslVersion};

    /// The problems of a worker with `flags` beside an ironic.conf of
    /// `ironic_conf`: (errors, warnings), as `config check` prints them.
    fn seal_check(ironic_conf: &str, flags: &[String]) -> (Vec<String>, Vec<String>) {
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("ironic.conf");
        std::fs::write(&conf, ironic_conf).unwrap();
        let files = super::super::Files {
            ironic_conf: Some(conf),
            toml: None,
        };
        let shown = |p: &Vec<super::super::Problem>| p.iter().map(|p| p.to_string()).collect();
        match super::super::read(&files, &[], flags) {
            Ok(loaded) => (Vec::new(), shown(&loaded.warnings)),
            Err(errors) => (shown(&errors), Vec::new()),
        }
    }

    /// `config check` names a deployment where the worker and the deploy
    /// interface disagree on the seal.
    #[test]
    fn one_side_sealed_and_the_other_not_is_named() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let key = |name: &str, byte: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, byte.repeat(32)).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
            path.display().to_string()
        };
        let (ours, theirs) = (key("ours.key", "ab"), key("theirs.key", "cd"));
        let worker = |extra: &[&str]| {
            let mut flags = vec![format!("amqp.seal_secret_file={ours}")];
            flags.extend(extra.iter().map(|s| s.to_string()));
            flags
        };
        let (errors, _) = seal_check("[image_worker]\n", &worker(&[]));
        assert!(
            errors
                .iter()
                .any(|e| e.contains("[amqp]seal_secret_file") && e.contains("seals no command")),
            "{errors:?}"
        );
        let (errors, warnings) = seal_check("[image_worker]\n", &worker(&["amqp.seal=send"]));
        assert!(errors.is_empty(), "{errors:?}");
        assert!(
            warnings.iter().any(|w| w.contains("[amqp]seal")),
            "{warnings:?}"
        );
        let interface = format!("[image_worker]\nseal_secret_file = {theirs}\n");
        let (errors, _) = seal_check(&interface, &[]);
        assert!(
            errors.iter().any(|e| e.contains("requires sealed answers")),
            "{errors:?}"
        );
        let (errors, _) = seal_check(&interface, &worker(&[]));
        assert!(
            errors.iter().any(|e| e.contains("shares no key")),
            "{errors:?}"
        );
        let same = format!("[image_worker]\nseal_secret_file = {ours}\n");
        assert_eq!(seal_check(&same, &worker(&[])).0, Vec::<String>::new());
        let rpc = "[image_worker]\ntransport = json-rpc\n";
        assert_eq!(seal_check(rpc, &worker(&[])).0, Vec::<String>::new());
    }

    #[test]
    fn an_unsafe_or_missing_key_file_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seal.key");
        std::fs::write(&path, "ab".repeat(32)).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let error = refusal(&[&format!("amqp.seal_secret_file={}", path.display())]).unwrap();
        assert!(
            error.contains("[amqp]seal_secret_file") && error.contains("mode 0644"),
            "{error}"
        );
        let error = refusal(&["amqp.seal=require"]).unwrap();
        assert!(
            error.contains("require needs [amqp]seal_secret_file"),
            "{error}"
        );
    }

    #[test]
    fn ssl_version_takes_oslo_messagings_names() {
        for (word, version) in [
            ("", SslVersion::Any),
            ("SSLv23", SslVersion::Any),
            ("TLS", SslVersion::Any),
            ("PROTOCOL_TLS", SslVersion::Any),
            ("TLSv1_2", SslVersion::Tls12),
            ("TLSv1.2", SslVersion::Tls12),
            ("TLSv1_3", SslVersion::Tls13),
            ("TLSv1.3", SslVersion::Tls13),
        ] {
            assert_eq!(word.parse(), Ok(version), "{word:?}");
        }
        assert_eq!(serde_json::to_value(SslVersion::Any).unwrap(), "");
        assert_eq!(SslVersion::Tls12.as_str(), "TLSv1_2");
        let refused = "\"TLSv1_1\": only TLSv1_2 and TLSv1_3 are supported (empty allows both)";
        assert_eq!("TLSv1_1".parse::<SslVersion>(), Err(refused.into()));
        let error = refusal(&["amqp.ssl_version=TLSv1_1"]).unwrap();
        assert!(
            error.contains("[amqp]ssl_version (--set amqp.ssl_version): "),
            "{error}"
        );
        assert!(error.contains(refused), "{error}");
    }

    #[test]
    fn queue_type_is_quorum_or_classic() {
        assert_eq!("quorum".parse(), Ok(QueueType::Quorum));
        assert_eq!("classic".parse(), Ok(QueueType::Classic));
        assert_eq!(QueueType::Classic.as_str(), "classic");
        let refused = "unknown value \"stream\" (quorum or classic)";
        assert_eq!("stream".parse::<QueueType>(), Err(refused.into()));
        let error = refusal(&["amqp.queue_type=stream"]).unwrap();
        assert!(
            error.contains(&format!(
                "[amqp]queue_type (--set amqp.queue_type): {refused}"
            )),
            "{error}"
        );
    }
}
