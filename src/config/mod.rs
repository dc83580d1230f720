//! Configuration: one TOML file using Ironic's own section and option names,
//! overridden by environment variables and command-line `--set` flags.
//!
//! Precedence (lowest first): built-in defaults; what the worker reads of
//! Ironic's own configuration (an ironic.conf, then oslo.config's
//! `OS_<GROUP>__<OPTION>` environment variables over it, as oslo.config
//! orders them); the worker's TOML file; environment variables
//! `IRONIC_IMAGE_WORKER__<SECTION>__<OPTION>`; then `--set
//! section.option=value` flags. The worker's own settings win over what it
//! reads of Ironic's. With no file at all every path defaults to a
//! directory the current user can write, so the worker starts without root.
//!
//! # This folder
//!
//! Holds the TOML configuration with Ironic's option names, its precedence
//! and validation (this module), and reading an existing ironic.conf
//! (`ironic_conf`). Must not know anything else of the worker.

pub(crate) mod ironic_conf;
mod peers;

pub use peers::{PeersSection, listener_url};

use crate::error::{Error, ErrorCode, Result};
use serde::{Deserialize, Deserializer};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Prefix of the environment variables that override configuration options.
pub const ENV_PREFIX: &str = "IRONIC_IMAGE_WORKER__";

/// The whole configuration, section by section as in ironic.conf.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// `[DEFAULT]`: the conductor host name and the raw-conversion switch.
    #[serde(rename = "DEFAULT")]
    pub default: DefaultSection,
    /// `[agent]`: how the agent downloads images.
    pub agent: AgentSection,
    /// `[deploy]`: where symlinks live and the URL they are published under.
    pub deploy: DeploySection,
    /// `[pxe]`: the image cache and per-node image directories.
    pub pxe: PxeSection,
    /// `[conductor]`: image safety policy.
    pub conductor: ConductorSection,
    /// `[amqp]`: the broker connection and topology names.
    pub amqp: AmqpSection,
    /// `[http]`: the embedded image server.
    pub http: HttpSection,
    /// `[metrics]`: the metrics and health listener.
    pub metrics: MetricsSection,
    /// `[source]`: how image sources are fetched.
    pub source: SourceSection,
    /// `[convert]`: limits of image conversion.
    pub convert: ConvertSection,
    /// `[cache]`: the worker's cache housekeeping.
    pub cache: CacheSection,
    /// `[glance]`: the Image API and its Keystone credentials (Ironic's own
    /// keystoneauth option names), for Glance image UUID sources.
    pub glance: GlanceSection,
    /// `[notifications]`: which nodes Ironic's notifications may act on.
    pub notifications: NotificationsSection,
    /// `[oci]`: OCI registries (`oci://` sources), Ironic's option names.
    pub oci: OciSection,
    /// `[peers]`: masters fetched from the other conductors' workers.
    pub peers: PeersSection,
}

/// `[oci]`: how `oci://` image sources reach their registry, with the names
/// and meanings of ironic.conf's `[oci]` options.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OciSection {
    /// A docker `config.json` (`{"auths": {"<registry>": {"auth": ...}}}`)
    /// with pre-shared credentials per registry, re-read on every use; empty
    /// for none.
    pub authentication_config: String,
    /// `true`, `false` (no TLS verification) or a CA bundle (PEM) that
    /// alone is trusted for registries; empty: `[source]verify_tls`.
    pub verify_ca: String,
    /// Whether a registry that does not speak HTTPS is tried over plain
    /// HTTP (test set-ups only).
    pub permit_fallback_to_http_transport: bool,
    /// Registries whose redirects (to their CDN) keep the registry's
    /// `Authorization` header: a redirect host equal to one of these, or
    /// under one of them; any other host gets the request without it.
    #[serde(deserialize_with = "list_opt")]
    pub secure_cdn_registries: Vec<String>,
}

impl Default for OciSection {
    fn default() -> Self {
        OciSection {
            authentication_config: String::new(),
            verify_ca: String::new(),
            permit_fallback_to_http_transport: false,
            secure_cdn_registries: [
                "registry.redhat.io",
                "registry.access.redhat.com",
                "docker.io",
                "registry-1.docker.io",
            ]
            .map(String::from)
            .to_vec(),
        }
    }
}

/// `[notifications]`: the worker acts on Ironic's notifications only for
/// nodes that delegate their image work to it; Ironic fails its own deploy
/// when the worker links the files of a node Ironic prepares itself.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NotificationsSection {
    /// Deploy interfaces (the payload's `deploy_interface`) whose nodes are
    /// acted on; `*` means every node.
    #[serde(deserialize_with = "list_opt")]
    pub deploy_interfaces: Vec<String>,
    /// Seconds after which a notification's prepare is not started any
    /// more (the deploy interface has given up on it by then; its
    /// `[image_worker]prepare_timeout` is 1800).
    pub max_age: u64,
}

impl Default for NotificationsSection {
    fn default() -> Self {
        NotificationsSection {
            deploy_interfaces: vec!["direct-worker".into()],
            max_age: 1800,
        }
    }
}

/// The directories Ironic never reads a `file://` source from, whatever
/// `[conductor]file_url_allowed_paths` says (Ironic's
/// `BLOCKED_FILE_URL_PATHS`, OSSA-2025-001): the path as written and the
/// file actually opened must lie outside them.
pub const BLOCKED_FILE_URL_PATHS: [&str; 6] = ["/dev", "/sys", "/proc", "/boot", "/etc", "/run"];

/// The blocked directory `path` is in (or is), if any.
pub fn blocked_dir(path: &Path) -> Option<&'static str> {
    BLOCKED_FILE_URL_PATHS
        .into_iter()
        .find(|dir| path.starts_with(dir))
}

/// Where the worker keeps its masters when it reads an ironic.conf and its
/// own file does not say otherwise: a directory of its own, never Ironic's,
/// on the same file system as Ironic's default `images_path`. (With no
/// configuration at all the default is a writable directory under the
/// state directory, so the worker starts without root.)
pub const SYSTEM_MASTER_PATH: &str = "/var/lib/ironic-image-worker/master_images";

/// `[glance]`: where Glance is and how to authenticate to it. The names are
/// those of ironic.conf's `[glance]` (keystoneauth) options.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GlanceSection {
    /// Image API base URL (without `/v2`); when empty, the `image` endpoint
    /// of the Keystone catalog is used.
    pub endpoint_override: String,
    /// `password`/`v3password`, `v3applicationcredential`, `admin_token`
    /// (a static token, sent as it is) or `none`/`noauth`.
    pub auth_type: String,
    /// Keystone URL (`.../v3` or its root).
    pub auth_url: String,
    /// Password authentication: user name.
    pub username: String,
    /// Password authentication: password (never logged).
    pub password: String,
    /// Domain of the user, by name.
    pub user_domain_name: String,
    /// Domain of the user, by id.
    pub user_domain_id: String,
    /// Project to scope the token to, by name.
    pub project_name: String,
    /// Project to scope the token to, by id.
    pub project_id: String,
    /// Domain of the project, by name.
    pub project_domain_name: String,
    /// Domain of the project, by id.
    pub project_domain_id: String,
    /// Application credential id.
    pub application_credential_id: String,
    /// Application credential secret (never logged).
    pub application_credential_secret: String,
    /// Static token for `admin_token` (never logged).
    pub token: String,
    /// Catalog region of the image endpoint.
    pub region_name: String,
    /// Catalog interfaces to try, in order.
    #[serde(deserialize_with = "list_opt")]
    pub valid_interfaces: Vec<String>,
    /// Skip TLS verification of Keystone and Glance.
    pub insecure: bool,
}

impl Default for GlanceSection {
    fn default() -> Self {
        GlanceSection {
            endpoint_override: String::new(),
            auth_type: "password".into(),
            auth_url: String::new(),
            username: String::new(),
            password: String::new(),
            user_domain_name: String::new(),
            user_domain_id: String::new(),
            project_name: String::new(),
            project_id: String::new(),
            project_domain_name: String::new(),
            project_domain_id: String::new(),
            application_credential_id: String::new(),
            application_credential_secret: String::new(),
            token: String::new(),
            region_name: String::new(),
            valid_interfaces: vec!["internal".into(), "public".into()],
            insecure: false,
        }
    }
}

/// `[cache]`: housekeeping of the master cache beyond Ironic's `[pxe]` limits.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheSection {
    /// Seconds between periodic clean-ups (TTL and size limit), 0 = never.
    pub clean_interval: u64,
    /// Seconds after which a node's files that no prepare asked for (files
    /// left by a conductor takeover) are removed by the periodic clean-up,
    /// 0 = never.
    pub node_files_ttl: u64,
    /// Group given to the directories shared with Ironic
    /// (`images_path/<node>/`, `http_root/<subdir>/`) when the worker
    /// creates them; empty = the worker's own group.
    pub shared_group: String,
    /// Octal mode of those directories (`"2775"` with a shared group).
    pub shared_dir_mode: String,
}

impl Default for CacheSection {
    fn default() -> Self {
        CacheSection {
            clean_interval: 600,
            node_files_ttl: 7 * 24 * 3600,
            shared_group: String::new(),
            shared_dir_mode: "0755".into(),
        }
    }
}

impl CacheSection {
    /// The group and mode of the directories shared with Ironic, checked:
    /// the worker keeps owner rwx, no setuid or sticky bit (a sticky
    /// directory would stop Ironic removing the worker's files), and a
    /// shared group needs group write access to be of any use.
    pub fn shared_dirs(&self) -> Result<crate::fsutil::DirMode> {
        let bad = |why: &str| {
            config_error(format!(
                "[cache]shared_dir_mode = {:?}: {why}",
                self.shared_dir_mode
            ))
        };
        let mode = u32::from_str_radix(self.shared_dir_mode.trim_start_matches("0o"), 8)
            .map_err(|_| bad("not an octal mode"))?;
        if mode & !0o2777 != 0 {
            return Err(bad("only permission bits and setgid (2000) are allowed"));
        }
        if mode & 0o700 != 0o700 {
            return Err(bad("the owner (the worker) needs rwx"));
        }
        let gid =
            match self.shared_group.as_str() {
                "" => None,
                name => Some(crate::fsutil::group_id(name).ok_or_else(|| {
                    config_error(format!("[cache]shared_group: no group {name:?}"))
                })?),
            };
        if gid.is_some() && mode & 0o070 != 0o070 {
            return Err(bad("a shared group needs rwx (for example 2775)"));
        }
        Ok(crate::fsutil::DirMode { mode, gid })
    }
}

/// `[DEFAULT]` options shared with Ironic.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DefaultSection {
    /// Conductor host name: only events for this host are acted on.
    pub host: String,
    /// Ironic's `force_raw_images` (default true, as in Ironic).
    pub force_raw_images: bool,
    /// Ironic's `raw_image_growth_factor` (default 2.0, at least 1.0): when
    /// the virtual size of an image to convert does not fit, the raw size
    /// is estimated as the image size times this (capped by the virtual
    /// size) for the space check.
    pub raw_image_growth_factor: f64,
    /// Ironic's `webserver_verify_ca` for http(s) sources and checksum
    /// files: a boolean (`True`/`False`, as oslo spells them) or the path
    /// of a CA bundle (a path that does not exist means `True`, as in
    /// Ironic). Unset: `[source]verify_tls` decides.
    #[serde(deserialize_with = "bool_or_string")]
    pub webserver_verify_ca: Option<String>,
    /// Ironic's `webserver_connection_timeout`, seconds: requests' single
    /// `timeout`, so both the connect timeout and the longest wait for a
    /// byte of an http(s) source. Unset: `[source]connect_timeout` and
    /// `read_timeout` decide.
    pub webserver_connection_timeout: Option<u64>,
}

/// `[agent]` options shared with Ironic.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentSection {
    /// `local`, `http` or `swift` (see docs/contract.md, "Which images are cached"); the worker defaults to `local`.
    pub image_download_source: String,
    /// Ironic's `stream_raw_images` (default true).
    pub stream_raw_images: bool,
    /// Ironic's `allow_md5_checksum` (default true): when false, a request
    /// whose only checksum is MD5 (inline or in a checksum file) is refused
    /// with `checksum_not_permitted`.
    pub allow_md5_checksum: bool,
}

/// `[deploy]` options shared with Ironic.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeploySection {
    /// Root directory served over HTTP.
    pub http_root: PathBuf,
    /// Base URL under which `http_root` is reachable by the nodes.
    pub http_url: String,
    /// Subdirectory of `http_root` holding the per-node symlinks.
    pub http_image_subdir: String,
    // Image server authentication (Ironic's names; Ironic hands the same
    // credentials to the agent in its image_info).
    /// `noauth` or `http_basic` (every image request must carry
    /// `image_server_user` / `image_server_password`).
    pub image_server_auth_strategy: String,
    /// User name of `http_basic`.
    pub image_server_user: String,
    /// Password of `http_basic` (never logged).
    pub image_server_password: String,
}

/// `[pxe]` options shared with Ironic.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PxeSection {
    /// The worker's own master image cache directory (never Ironic's).
    pub instance_master_path: PathBuf,
    /// Per-node image directories (`<images_path>/<node>/disk`).
    pub images_path: PathBuf,
    /// Cache size limit in MiB.
    pub image_cache_size: u64,
    /// Cache TTL in minutes.
    pub image_cache_ttl: u64,
}

/// `[conductor]` options shared with Ironic.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConductorSection {
    /// Formats a detected image may have.
    #[serde(deserialize_with = "list_opt")]
    pub permitted_image_formats: Vec<String>,
    /// Directories under which `file://` sources are allowed (never
    /// under Ironic's always-refused system directories, see
    /// [`BLOCKED_FILE_URL_PATHS`]).
    #[serde(deserialize_with = "path_list_opt")]
    pub file_url_allowed_paths: Vec<PathBuf>,
    /// Ironic's `disable_deep_image_inspection` (default false): when true,
    /// the detected format is neither matched against `image_disk_format`
    /// nor against `permitted_image_formats`. The structural checks the
    /// converter relies on (backing and data files, encryption) stay.
    pub disable_deep_image_inspection: bool,
    /// Ironic's `disable_support_for_checksum_files` (default false): when
    /// true, a checksum given as an http(s) URL is refused with
    /// `checksum_not_permitted`.
    pub disable_support_for_checksum_files: bool,
    /// Ironic's `conductor_always_validates_images` (default false): with
    /// `image_download_source = http`, an http(s) source is downloaded,
    /// verified and inspected before its URL is answered.
    pub conductor_always_validates_images: bool,
}

/// `[amqp]`: the worker's broker settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AmqpSection {
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
    pub ssl_version: String,
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
    pub queue_type: String,
    /// Redeliveries allowed before a quorum queue dead-letters a message.
    pub delivery_limit: u32,
    /// Messages handled at once (AMQP prefetch).
    pub prefetch: u16,
    /// Whether to bind the per-host queue to Ironic's notification exchange.
    pub bind_notifications: bool,
    /// Ironic's notification exchange (`[DEFAULT]control_exchange`).
    pub notification_exchange: String,
    /// Notification topics (routing keys get `.info` / `.error` appended).
    #[serde(deserialize_with = "list_opt")]
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
}

/// `[http]`: the embedded image server.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpSection {
    /// Listen address of the image server.
    pub listen: SocketAddr,
    /// Seconds a client has to send a complete request header (also the
    /// longest a keep-alive connection waits for its next request).
    pub header_timeout: u64,
    /// Seconds without a byte received or sent (a client that stopped
    /// reading a download) before a connection is closed.
    pub idle_timeout: u64,
    /// Connections the image server keeps open at once; 0 derives it from
    /// the process file-descriptor limit, keeping descriptors for the
    /// pipeline, the broker and the metrics listener.
    pub max_connections: usize,
    // HTTPS (the operations listener stays plain).
    /// Certificate chain (PEM) of the image server; with `tls_key_file`
    /// the server speaks only HTTPS. Reloaded when the file changes.
    pub tls_cert_file: String,
    /// Private key (PEM) of `tls_cert_file`; never logged.
    pub tls_key_file: String,
    /// Lowest TLS version accepted: `1.3` (the default, as Ironic's own
    /// servers) or `1.2`.
    pub tls_min_version: String,
}

/// `[metrics]`: the metrics / health listener.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsSection {
    /// Listen address for `/metrics`, `/healthz`, `/readyz`.
    pub listen: SocketAddr,
}

/// `[source]`: download behaviour.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SourceSection {
    /// Seconds to establish a connection.
    pub connect_timeout: u64,
    /// Seconds without receiving a byte before a download is abandoned.
    pub read_timeout: u64,
    /// Retries after a failed attempt (connection errors, 5xx, broken or too
    /// slow streams): `retries = 2` makes at most 3 attempts.
    pub retries: u32,
    /// Whether TLS certificates of https sources are verified.
    pub verify_tls: bool,
    /// Slowest acceptable download, bytes per second, averaged over
    /// `min_rate_window`; a slower attempt fails as "too slow" (0 = no limit).
    pub min_rate: u64,
    /// Seconds over which `min_rate` is measured.
    pub min_rate_window: u64,
    /// Seconds one download may take in all, every attempt included
    /// (0 = no limit).
    pub download_deadline: u64,
    /// A download averaging fewer bytes per second than this after
    /// `slow_after` seconds gives back its prepare slot (the slow lane), so
    /// slow sources never starve the others (0 = never).
    pub slow_rate: u64,
    /// Seconds a download runs before its rate is judged for the slow lane.
    pub slow_after: u64,
    /// Downloads in the slow lane at once (each still holds its
    /// connection, a few MiB of buffers and its node's files); when it is
    /// full, a slow download keeps its prepare slot.
    pub slow_downloads: u32,
    /// Redirects followed per request.
    pub max_redirects: u32,
    /// Whether a redirect, or a host name resolving there, may lead a source
    /// to a loopback, link-local or unspecified address (this host's own
    /// services, a metadata service); a URL naming one literally may always.
    /// The worker's own listeners are refused either way.
    pub allow_local_redirects: bool,
}

/// The configuration files to read, lowest precedence first.
#[derive(Debug, Clone, Default)]
pub struct Files {
    /// An existing ironic.conf: the options shared with the conductor.
    pub ironic_conf: Option<PathBuf>,
    /// The worker's own TOML file.
    pub toml: Option<PathBuf>,
}

/// Directory for the default paths: `$XDG_STATE_HOME/ironic-image-worker`,
/// else `./ironic-image-worker-state` (both writable without root).
pub fn default_state_dir() -> PathBuf {
    match std::env::var_os("XDG_STATE_HOME") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir).join("ironic-image-worker"),
        _ => PathBuf::from("ironic-image-worker-state"),
    }
}

/// The machine's host name, Ironic's default for `[DEFAULT]host`.
pub fn system_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

impl Default for DefaultSection {
    fn default() -> Self {
        DefaultSection {
            host: system_hostname(),
            force_raw_images: true,
            raw_image_growth_factor: 2.0,
            webserver_verify_ca: None,
            webserver_connection_timeout: None,
        }
    }
}

impl Default for AgentSection {
    fn default() -> Self {
        AgentSection {
            image_download_source: "local".into(),
            stream_raw_images: true,
            allow_md5_checksum: true,
        }
    }
}

impl Default for DeploySection {
    fn default() -> Self {
        DeploySection {
            http_root: default_state_dir().join("httpboot"),
            http_url: String::new(),
            http_image_subdir: "agent_images".into(),
            image_server_auth_strategy: "noauth".into(),
            image_server_user: String::new(),
            image_server_password: String::new(),
        }
    }
}

impl Default for PxeSection {
    fn default() -> Self {
        let base = default_state_dir();
        PxeSection {
            instance_master_path: base.join("master_images"),
            images_path: base.join("images"),
            image_cache_size: 20480,
            image_cache_ttl: 10080,
        }
    }
}

impl Default for ConductorSection {
    fn default() -> Self {
        ConductorSection {
            permitted_image_formats: ["raw", "gpt", "qcow2", "iso"].map(String::from).to_vec(),
            file_url_allowed_paths: [
                "/var/lib/ironic",
                "/shared/html",
                "/templates",
                "/opt/cache/files",
                "/vagrant",
            ]
            .map(PathBuf::from)
            .to_vec(),
            disable_deep_image_inspection: false,
            disable_support_for_checksum_files: false,
            conductor_always_validates_images: false,
        }
    }
}

impl Default for AmqpSection {
    fn default() -> Self {
        AmqpSection {
            url: vec!["amqp://guest:guest@127.0.0.1:5672/%2f".into()],
            heartbeat: 10,
            connect_timeout: 10,
            ssl_ca_file: String::new(),
            ssl_cert_file: String::new(),
            ssl_key_file: String::new(),
            ssl_verify_hostname: true,
            ssl_version: String::new(),
            consumer_timeout: 1800,
            command_exchange: "ironic-image-worker".into(),
            queue_prefix: "ironic-image-worker".into(),
            dead_letter_exchange: "ironic-image-worker.dlx".into(),
            events_exchange: "ironic-image-worker.events".into(),
            queue_type: "quorum".into(),
            delivery_limit: 5,
            prefetch: 32,
            bind_notifications: true,
            notification_exchange: "ironic".into(),
            notification_topics: vec!["ironic_versioned_notifications".into()],
            notification_exchange_durable: false,
            shutdown_grace: 30,
            max_message_bytes: 4 << 20,
        }
    }
}

impl Default for HttpSection {
    fn default() -> Self {
        HttpSection {
            listen: SocketAddr::from(([0, 0, 0, 0], 8080)),
            header_timeout: 60,
            idle_timeout: 60,
            max_connections: 0,
            tls_cert_file: String::new(),
            tls_key_file: String::new(),
            tls_min_version: "1.3".into(),
        }
    }
}

impl Default for MetricsSection {
    fn default() -> Self {
        MetricsSection {
            listen: SocketAddr::from(([127, 0, 0, 1], 9102)),
        }
    }
}

/// `[convert]`: how conversions to raw are bounded.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConvertSection {
    /// Address-space limit of the converter process, MiB.
    pub memory_limit_mib: u64,
    /// Seconds a conversion may always take.
    pub min_timeout: u64,
    /// Slowest acceptable conversion rate (MiB of virtual disk per second)
    /// beyond `min_timeout`.
    pub min_rate_mib: u64,
    /// Largest virtual size of an image, GiB.
    pub max_virtual_size_gib: u64,
    /// The earlier name of `[DEFAULT]raw_image_growth_factor`, still
    /// accepted: when set it wins (it is the worker's own setting).
    pub raw_image_growth_factor: Option<f64>,
    /// Convert a qcow2 from an http(s)/Glance source while it downloads
    /// (the result is used only once the download is verified).
    pub stream_while_downloading: bool,
}

impl Default for ConvertSection {
    fn default() -> Self {
        ConvertSection {
            memory_limit_mib: 2048,
            min_timeout: 300,
            min_rate_mib: 20,
            max_virtual_size_gib: 1024,
            raw_image_growth_factor: None,
            stream_while_downloading: true,
        }
    }
}

impl ConvertSection {
    /// The converter limits in the units the converter uses.
    pub fn limits(&self) -> crate::image::convert::Limits {
        crate::image::convert::Limits {
            memory: self.memory_limit_mib.saturating_mul(1 << 20),
            min_timeout: std::time::Duration::from_secs(self.min_timeout),
            min_rate: self.min_rate_mib.saturating_mul(1 << 20),
        }
    }

    /// The limits of the qcow2 header check.
    pub fn qcow2_limits(&self) -> crate::image::qcow2::Limits {
        crate::image::qcow2::Limits {
            max_virtual_size: self.max_virtual_size_gib.saturating_mul(1 << 30),
        }
    }
}

impl Default for SourceSection {
    fn default() -> Self {
        SourceSection {
            connect_timeout: 10,
            read_timeout: 60,
            retries: 2,
            verify_tls: true,
            min_rate: 1024,
            min_rate_window: 60,
            download_deadline: 6 * 3600,
            slow_rate: 1 << 20,
            slow_after: 60,
            slow_downloads: 16,
            max_redirects: 10,
            allow_local_redirects: false,
        }
    }
}

/// Ironic list options are comma-separated strings; TOML arrays work too.
fn list_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        One(String),
        Many(Vec<String>),
    }
    let items = match Either::deserialize(d)? {
        Either::One(s) => s.split(',').map(str::to_string).collect(),
        Either::Many(v) => v,
    };
    Ok(items
        .into_iter()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect())
}

/// An option that is a boolean or a string (`webserver_verify_ca`): a TOML
/// boolean is kept as its text.
fn bool_or_string<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        Bool(bool),
        Text(String),
    }
    Ok(Some(match Either::deserialize(d)? {
        Either::Bool(b) => b.to_string(),
        Either::Text(s) => s,
    }))
}

/// `[amqp]url`: a TOML array of URLs, or one string holding a
/// comma-separated list (see [`split_broker_urls`]).
fn url_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        One(String),
        Many(Vec<String>),
    }
    let mut out = Vec::new();
    let items = match Either::deserialize(d)? {
        Either::One(s) => vec![s],
        Either::Many(v) => v,
    };
    for item in items {
        out.extend(split_broker_urls(&item).map_err(serde::de::Error::custom)?);
    }
    Ok(out)
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

/// Masks every `user:password@` in a comma-separated list of URLs or hosts.
fn redact_url_list(value: &str) -> String {
    value
        .split(',')
        .map(|piece| match piece.rfind('@') {
            Some(at) => {
                let (cred, host) = piece.split_at(at);
                let (prefix, cred) = match cred.find("://") {
                    Some(i) => (&cred[..i + 3], &cred[i + 3..]),
                    None => ("", cred),
                };
                match cred.split_once(':') {
                    Some((user, _)) => format!("{prefix}{user}:***{host}"),
                    None => format!("{prefix}{cred}{host}"),
                }
            }
            None => piece.to_string(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

fn path_list_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<PathBuf>, D::Error> {
    Ok(list_opt(d)?.into_iter().map(PathBuf::from).collect())
}

impl Config {
    /// Loads the configuration: defaults, then the shared options of
    /// `files.ironic_conf`, then `files.toml`, then the process environment,
    /// then `overrides` (`section.option=value`).
    pub fn load(files: &Files, overrides: &[String]) -> Result<Config> {
        let env: Vec<(String, String)> = std::env::vars().collect();
        Self::load_from(files, &env, overrides)
    }

    /// [`Config::load`] with an explicit environment, for tests.
    pub fn load_from(
        files: &Files,
        env: &[(String, String)],
        overrides: &[String],
    ) -> Result<Config> {
        let ironic = crate::config::ironic_conf::load(files.ironic_conf.as_deref(), env)?;
        let mut table = ironic.table;
        if let Some(path) = &files.toml {
            let text = std::fs::read_to_string(path)
                .map_err(|e| config_error(format!("cannot read {}: {e}", path.display())))?;
            let own = text
                .parse::<toml::Table>()
                .map_err(|e| config_error(format!("{}: {e}", path.display())))?;
            for (section, options) in own {
                match (table.get_mut(&section), options) {
                    (Some(toml::Value::Table(base)), toml::Value::Table(options)) => {
                        base.extend(options)
                    }
                    (_, options) => {
                        table.insert(section, options);
                    }
                }
            }
        }
        for (name, value) in env {
            if let Some(rest) = name.strip_prefix(ENV_PREFIX) {
                let (section, key) = rest.split_once("__").ok_or_else(|| {
                    config_error(format!("{name}: expected {ENV_PREFIX}<SECTION>__<OPTION>"))
                })?;
                let section = if section == "DEFAULT" {
                    section.to_string()
                } else {
                    section.to_ascii_lowercase()
                };
                set_option(&mut table, &section, &key.to_ascii_lowercase(), value);
            }
        }
        for item in overrides {
            let (path, value) = item.split_once('=').ok_or_else(|| {
                config_error(format!("--set {item}: expected SECTION.OPTION=VALUE"))
            })?;
            let (section, key) = path.split_once('.').ok_or_else(|| {
                config_error(format!("--set {item}: expected SECTION.OPTION=VALUE"))
            })?;
            set_option(&mut table, section, key, value);
        }
        let config: Config = table
            .try_into()
            .map_err(|e: toml::de::Error| config_error(e.to_string()))?;
        config.validate()?;
        if let Some(path) = &ironic.master_path {
            config.check_master_not_ironics(path)?;
        }
        Ok(config)
    }

    fn validate(&self) -> Result<()> {
        match self.agent.image_download_source.as_str() {
            "local" | "http" | "swift" => {}
            other => {
                return Err(config_error(format!(
                    "[agent]image_download_source: unknown value {other:?} (local, http or swift)"
                )));
            }
        }
        self.validate_amqp()?;
        match self.amqp.queue_type.as_str() {
            "quorum" | "classic" => {}
            other => {
                return Err(config_error(format!(
                    "[amqp]queue_type: unknown value {other:?} (quorum or classic)"
                )));
            }
        }
        if !crate::node::is_valid_segment(&self.deploy.http_image_subdir) {
            return Err(config_error(
                "[deploy]http_image_subdir must be one plain directory name".to_string(),
            ));
        }
        self.validate_served_dirs()?;
        self.validate_image_server()?;
        self.cache.shared_dirs()?;
        self.validate_file_url_paths()?;
        self.peers.validate()?;
        self.validate_limits()
    }

    /// `[http]tls_*` and `[deploy]image_server_*`: TLS files both given and
    /// readable, a version this TLS stack speaks, an `http_url` that speaks
    /// TLS when the server does, credentials when `http_basic` asks for them.
    fn validate_image_server(&self) -> Result<()> {
        let h = &self.http;
        if h.tls_cert_file.is_empty() != h.tls_key_file.is_empty() {
            return Err(config_error(
                "[http]tls_cert_file and tls_key_file go together".into(),
            ));
        }
        for (name, path) in [
            ("tls_cert_file", &h.tls_cert_file),
            ("tls_key_file", &h.tls_key_file),
        ] {
            if !path.is_empty()
                && let Err(e) = std::fs::metadata(path)
            {
                return Err(config_error(format!("[http]{name} {path}: {e}")));
            }
        }
        if !matches!(h.tls_min_version.as_str(), "1.2" | "1.3") {
            return Err(config_error(format!(
                "[http]tls_min_version {:?}: 1.2 or 1.3",
                h.tls_min_version
            )));
        }
        if self.tls_enabled() && self.deploy.http_url.starts_with("http://") {
            return Err(config_error(
                "[deploy]http_url is http:// but the image server speaks only HTTPS \
                 ([http]tls_cert_file is set); use https://"
                    .into(),
            ));
        }
        let d = &self.deploy;
        match d.image_server_auth_strategy.as_str() {
            "noauth" => Ok(()),
            "http_basic"
                if d.image_server_user.is_empty() || d.image_server_password.is_empty() =>
            {
                Err(config_error(
                    "[deploy]image_server_auth_strategy http_basic needs image_server_user \
                     and image_server_password"
                        .into(),
                ))
            }
            "http_basic" if d.image_server_user.contains(':') => Err(config_error(
                "[deploy]image_server_user must not contain ':' (HTTP Basic)".into(),
            )),
            "http_basic" => Ok(()),
            other => Err(config_error(format!(
                "[deploy]image_server_auth_strategy: unknown value {other:?} (noauth or http_basic)"
            ))),
        }
    }

    /// Whether the image server speaks HTTPS.
    pub fn tls_enabled(&self) -> bool {
        !self.http.tls_cert_file.is_empty()
    }

    /// The master directory and `images_path` must not lie inside
    /// `http_root`: everything there is served by path (masters, sidecars,
    /// lock files, temporaries), not only the published symlinks.
    fn validate_served_dirs(&self) -> Result<()> {
        let root = crate::fsutil::resolve(&self.deploy.http_root);
        for (name, dir) in [
            ("[pxe]instance_master_path", &self.pxe.instance_master_path),
            ("[pxe]images_path", &self.pxe.images_path),
        ] {
            if crate::fsutil::resolve(dir).starts_with(&root) {
                return Err(config_error(format!(
                    "{name} {} is inside [deploy]http_root {}, which would serve its files; \
                     use a directory outside it",
                    dir.display(),
                    self.deploy.http_root.display()
                )));
            }
        }
        Ok(())
    }

    /// `[conductor]file_url_allowed_paths` holds absolute paths without
    /// `.` or `..` (Ironic's `ExplicitAbsolutePath`); one inside a directory
    /// Ironic never reads file URLs from is only warned about (Ironic
    /// starts with it too), as no file there is ever read.
    fn validate_file_url_paths(&self) -> Result<()> {
        for dir in &self.conductor.file_url_allowed_paths {
            let explicit = dir.is_absolute()
                && dir.components().all(|c| {
                    !matches!(
                        c,
                        std::path::Component::ParentDir | std::path::Component::CurDir
                    )
                });
            if !explicit {
                return Err(config_error(format!(
                    "[conductor]file_url_allowed_paths: {} is not an absolute path without \
                     . or ..",
                    dir.display()
                )));
            }
            if let Some(blocked) = blocked_dir(dir) {
                tracing::warn!(
                    "[conductor]file_url_allowed_paths: {} is under {blocked}, from which \
                     file URLs are never read",
                    dir.display()
                );
            }
        }
        Ok(())
    }

    /// Limits must be limits: no zero that means "unlimited" to the broker,
    /// no unit conversion that overflows (and would wrap to a tiny limit).
    fn validate_limits(&self) -> Result<()> {
        let fits = |name: &str, value: u64, unit: u64| {
            value.checked_mul(unit).map(|_| ()).ok_or_else(|| {
                config_error(format!(
                    "{name} = {value} is too large (at most {})",
                    u64::MAX / unit
                ))
            })
        };
        fits(
            "[convert]memory_limit_mib",
            self.convert.memory_limit_mib,
            1 << 20,
        )?;
        fits("[convert]min_rate_mib", self.convert.min_rate_mib, 1 << 20)?;
        fits(
            "[convert]max_virtual_size_gib",
            self.convert.max_virtual_size_gib,
            1 << 30,
        )?;
        fits("[pxe]image_cache_size", self.pxe.image_cache_size, 1 << 20)?;
        // Minutes to seconds, kept as a signed number of seconds.
        fits("[pxe]image_cache_ttl", self.pxe.image_cache_ttl, 60 * 2)?;
        if self.amqp.prefetch == 0 {
            return Err(config_error(
                "[amqp]prefetch must be at least 1 (0 means unlimited to the broker)".into(),
            ));
        }
        if i32::try_from(self.amqp.delivery_limit).is_err() {
            return Err(config_error(format!(
                "[amqp]delivery_limit = {} is too large (at most {})",
                self.amqp.delivery_limit,
                i32::MAX
            )));
        }
        let factor = self.raw_image_growth_factor();
        if !factor.is_finite() || factor < 1.0 {
            return Err(config_error(format!(
                "[DEFAULT]raw_image_growth_factor = {factor} must be a number of at least 1.0 \
                 (as in Ironic)"
            )));
        }
        if self.source.min_rate > 0 && self.source.min_rate_window == 0 {
            return Err(config_error(
                "[source]min_rate_window must be at least 1 second".into(),
            ));
        }
        Ok(())
    }

    /// `[amqp]`: every broker URL parses, the TLS options name readable
    /// files, and the TLS version is one this TLS stack speaks.
    fn validate_amqp(&self) -> Result<()> {
        let a = &self.amqp;
        if a.url.is_empty() {
            return Err(config_error("[amqp]url: no broker URL".into()));
        }
        for (i, url) in a.url.iter().enumerate() {
            if let Err(e) = url.parse::<lapin::uri::AMQPUri>() {
                return Err(config_error(format!(
                    "[amqp]url #{} {}: {e}",
                    i + 1,
                    redact_url_list(url)
                )));
            }
            if !(url.starts_with("amqp://") || url.starts_with("amqps://")) {
                return Err(config_error(format!(
                    "[amqp]url #{} {}: the scheme must be amqp:// or amqps://",
                    i + 1,
                    redact_url_list(url)
                )));
            }
        }
        if a.ssl_cert_file.is_empty() != a.ssl_key_file.is_empty() {
            return Err(config_error(
                "[amqp]ssl_cert_file and ssl_key_file go together".into(),
            ));
        }
        for (name, path) in [
            ("ssl_ca_file", &a.ssl_ca_file),
            ("ssl_cert_file", &a.ssl_cert_file),
            ("ssl_key_file", &a.ssl_key_file),
        ] {
            if !path.is_empty()
                && let Err(e) = std::fs::metadata(path)
            {
                return Err(config_error(format!("[amqp]{name} {path}: {e}")));
            }
        }
        match a.ssl_version.as_str() {
            "" | "SSLv23" | "TLS" | "PROTOCOL_TLS" | "TLSv1_2" | "TLSv1.2" | "TLSv1_3"
            | "TLSv1.3" => Ok(()),
            other => Err(config_error(format!(
                "[amqp]ssl_version {other:?}: only TLSv1_2 and TLSv1_3 are supported \
                 (empty allows both)"
            ))),
        }
    }

    /// Refuses a master directory that is Ironic's own (`ironic`, its
    /// `[pxe]instance_master_path`): Ironic's clean-up deletes every unlinked
    /// file there and its downloads collide with the worker's.
    pub fn check_master_not_ironics(&self, ironic: &std::path::Path) -> Result<()> {
        if crate::fsutil::same_path(&self.pxe.instance_master_path, ironic) {
            return Err(config_error(format!(
                "[pxe]instance_master_path {} is Ironic's master image directory; the worker \
                 needs a directory of its own (default {SYSTEM_MASTER_PATH}, on the same file \
                 system as [pxe]images_path)",
                self.pxe.instance_master_path.display()
            )));
        }
        Ok(())
    }

    /// `[DEFAULT]raw_image_growth_factor`, or its earlier name
    /// `[convert]raw_image_growth_factor` when that is set.
    pub fn raw_image_growth_factor(&self) -> f64 {
        self.convert
            .raw_image_growth_factor
            .unwrap_or(self.default.raw_image_growth_factor)
    }

    /// Ironic's estimate of the raw size of an image of `file_size` bytes
    /// describing `virtual_size` bytes, for space checks before converting.
    pub fn raw_size_estimate(&self, file_size: u64, virtual_size: u64) -> u64 {
        ((file_size as f64 * self.raw_image_growth_factor()) as u64).min(virtual_size)
    }

    /// How http(s) sources and checksum files verify TLS certificates:
    /// `[DEFAULT]webserver_verify_ca` when set (oslo's booleans, or a CA
    /// bundle path; a path that does not exist means the system store, as
    /// Ironic documents), else `[source]verify_tls`.
    pub fn source_tls(&self) -> SourceTls {
        let Some(value) = self.default.webserver_verify_ca.as_deref() else {
            return match self.source.verify_tls {
                true => SourceTls::System,
                false => SourceTls::Insecure,
            };
        };
        match parse_oslo_bool(value) {
            Some(true) => SourceTls::System,
            Some(false) => SourceTls::Insecure,
            None if Path::new(value.trim()).exists() => {
                SourceTls::Bundle(PathBuf::from(value.trim()))
            }
            None => {
                tracing::warn!(
                    "[DEFAULT]webserver_verify_ca {value:?} is neither a boolean nor an existing \
                     file: the system trust store is used, as in Ironic"
                );
                SourceTls::System
            }
        }
    }

    /// Connect timeout and longest wait for a byte of http(s) sources, in
    /// seconds: `[DEFAULT]webserver_connection_timeout` for both when set
    /// (requests' single `timeout`, as Ironic passes it), else
    /// `[source]connect_timeout` and `read_timeout`.
    pub fn source_timeouts(&self) -> (u64, u64) {
        match self.default.webserver_connection_timeout {
            Some(t) => (t, t),
            None => (self.source.connect_timeout, self.source.read_timeout),
        }
    }

    /// The URL prefix published for node images: `http_url` or, when unset,
    /// one derived from the image server's listen address.
    pub fn http_url(&self) -> String {
        if !self.deploy.http_url.is_empty() {
            return self.deploy.http_url.trim_end_matches('/').to_string();
        }
        let addr = self.http.listen;
        let host = if addr.ip().is_unspecified() {
            "127.0.0.1".to_string()
        } else if addr.is_ipv6() {
            format!("[{}]", addr.ip())
        } else {
            addr.ip().to_string()
        };
        let scheme = if self.tls_enabled() { "https" } else { "http" };
        format!("{scheme}://{host}:{}", addr.port())
    }

    /// The cache policy from `[pxe]image_cache_size` (MiB) and `image_cache_ttl` (minutes).
    pub fn eviction_policy(&self) -> crate::store::eviction::Policy {
        crate::store::eviction::Policy {
            size_limit: self.pxe.image_cache_size.saturating_mul(1 << 20),
            ttl: i64::try_from(self.pxe.image_cache_ttl.saturating_mul(60)).unwrap_or(i64::MAX),
        }
    }

    /// The broker URLs with their passwords masked, for logs.
    pub fn amqp_url_redacted(&self) -> String {
        self.amqp
            .url
            .iter()
            .map(|u| redact_url_list(u))
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// How TLS certificates of http(s) sources are verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceTls {
    /// Against the system trust store.
    System,
    /// Not at all.
    Insecure,
    /// Against this CA bundle (PEM) only, as requests' `verify=<path>`.
    Bundle(PathBuf),
}

/// oslo.utils' `bool_from_string` (strict): `1/t/true/on/y/yes` and
/// `0/f/false/off/n/no`, any case; anything else is not a boolean.
pub fn parse_oslo_bool(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "t" | "true" | "on" | "y" | "yes" => Some(true),
        "0" | "f" | "false" | "off" | "n" | "no" => Some(false),
        _ => None,
    }
}

/// Masks the secrets of a URL, for events, logs, errors and the files the
/// worker writes: the user-info (`http://user:password@host/` and
/// `http://TOKEN@host/` both become `http://***@host/`) and the values of
/// query parameters that carry signatures or tokens (`X-Amz-Signature`,
/// `temp_url_sig`, `sig`, `token`...: see [`is_secret_param`]). Works on
/// the text, so URLs that do not parse are masked too; anything without
/// `scheme://` is returned as it is (Glance ids).
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_string();
    };
    let rest_at = scheme_end + 3;
    let rest = &url[rest_at..];
    let authority_len = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let mut out = String::with_capacity(url.len());
    out.push_str(&url[..rest_at]);
    match rest[..authority_len].rfind('@') {
        Some(at) => {
            out.push_str("***");
            out.push_str(&rest[at..authority_len]);
        }
        None => out.push_str(&rest[..authority_len]),
    }
    let tail = &rest[authority_len..];
    let (before_fragment, fragment) = tail.split_at(tail.find('#').unwrap_or(tail.len()));
    match before_fragment.split_once('?') {
        Some((path, query)) => {
            out.push_str(path);
            out.push('?');
            let pairs: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((key, _)) if is_secret_param(key) => format!("{key}=***"),
                    _ => pair.to_string(),
                })
                .collect();
            out.push_str(&pairs.join("&"));
        }
        None => out.push_str(before_fragment),
    }
    out.push_str(fragment);
    out
}

/// Whether a query parameter's value may be a credential: its name mentions
/// a signature, a token, a key, a secret, a password, a credential or
/// authentication (S3 and Swift temporary URLs, SAS tokens, API keys).
fn is_secret_param(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    [
        "sig",
        "token",
        "key",
        "secret",
        "passw",
        "credential",
        "auth",
    ]
    .iter()
    .any(|word| key.contains(word))
}

fn config_error(message: String) -> Error {
    Error::new(ErrorCode::Internal, format!("configuration: {message}"))
}

/// Sets `[section] key = value` from the environment or `--set`: as the
/// TOML value it spells (numbers, booleans, arrays) when the option takes
/// that type, otherwise as a string, so `PASSWORD=123456` stays a string.
fn set_option(table: &mut toml::Table, section: &str, key: &str, value: &str) {
    let as_string = toml::Value::String(value.to_string());
    let parsed = format!("v = {value}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .filter(|typed| {
            typed.is_str()
                || option_accepts(section, key, typed)
                || !option_accepts(section, key, &as_string)
        })
        .unwrap_or(as_string);
    let entry = table
        .entry(section.to_string())
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    if let toml::Value::Table(section_table) = entry {
        section_table.insert(key.to_string(), parsed);
    }
}

/// Whether `[section] key = value` alone deserializes.
fn option_accepts(section: &str, key: &str, value: &toml::Value) -> bool {
    let mut options = toml::Table::new();
    options.insert(key.to_string(), value.clone());
    let mut table = toml::Table::new();
    table.insert(section.to_string(), toml::Value::Table(options));
    table.try_into::<Config>().is_ok()
}

#[cfg(test)]
mod tests {
    use super::{Config, Files, SourceTls, redact_url};

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn ironic_conf(text: &str) -> (tempfile::TempDir, Files) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ironic.conf");
        std::fs::write(&path, text).unwrap();
        let files = Files {
            ironic_conf: Some(path),
            toml: None,
        };
        (dir, files)
    }

    /// oslo.config's environment source: `OS_<GROUP>__<OPTION>`, over the
    /// ironic.conf and below the worker's own settings.
    #[test]
    fn oslo_environment_variables_are_read_as_oslo_reads_them() {
        let c = Config::load_from(
            &Files::default(),
            &env(&[
                ("OS_AGENT__ALLOW_MD5_CHECKSUM", "false"),
                ("OS_CONDUCTOR__DISABLE_DEEP_IMAGE_INSPECTION", "yes"),
                ("OS_DEFAULT__RAW_IMAGE_GROWTH_FACTOR", "1.5"),
                ("OS_DEFAULT__WEBSERVER_CONNECTION_TIMEOUT", "7"),
                ("OS_AUTH_URL", "http://keystone/"),
                ("OS_AGENT__NOT_AN_OPTION_OF_OURS", "1"),
            ]),
            &[],
        )
        .unwrap();
        assert!(!c.agent.allow_md5_checksum);
        assert!(c.conductor.disable_deep_image_inspection);
        assert_eq!(c.raw_image_growth_factor(), 1.5);
        assert_eq!(c.source_timeouts(), (7, 7));
        // Without an ironic.conf, the variables bring no Ironic path default.
        assert_ne!(c.deploy.http_root, std::path::PathBuf::from("/httpboot"));

        let (_dir, files) = ironic_conf(
            "[agent]\nallow_md5_checksum = true\n[conductor]\ndisable_support_for_checksum_files = true\n",
        );
        let over_file = Config::load_from(
            &files,
            &env(&[("OS_AGENT__ALLOW_MD5_CHECKSUM", "false")]),
            &["pxe.instance_master_path=/tmp/iiw-unit-master".into()],
        )
        .unwrap();
        assert!(!over_file.agent.allow_md5_checksum, "env over ironic.conf");
        assert!(over_file.conductor.disable_support_for_checksum_files);
        assert_eq!(
            over_file.conductor.file_url_allowed_paths,
            [std::path::PathBuf::from("/var/lib/ironic")],
            "Ironic's default when its file does not set it"
        );
        let worker_wins = Config::load_from(
            &files,
            &env(&[
                ("OS_AGENT__ALLOW_MD5_CHECKSUM", "false"),
                ("IRONIC_IMAGE_WORKER__AGENT__ALLOW_MD5_CHECKSUM", "true"),
            ]),
            &["pxe.instance_master_path=/tmp/iiw-unit-master".into()],
        )
        .unwrap();
        assert!(worker_wins.agent.allow_md5_checksum);

        for bad in [
            ("OS_DEFAULT__RAW_IMAGE_GROWTH_FACTOR", "0.5"),
            ("OS_AGENT__ALLOW_MD5_CHECKSUM", "maybe"),
            ("OS_CONDUCTOR__FILE_URL_ALLOWED_PATHS", "/var/lib/../etc"),
        ] {
            assert!(
                Config::load_from(&Files::default(), &env(&[bad]), &[]).is_err(),
                "{bad:?}"
            );
        }
        // Ironic's own master directory, named by the environment, is refused.
        let shared = Config::load_from(
            &Files::default(),
            &env(&[("OS_PXE__INSTANCE_MASTER_PATH", "/tmp/iiw-unit-master")]),
            &["pxe.instance_master_path=/tmp/iiw-unit-master".into()],
        );
        assert!(shared.is_err());
    }

    #[test]
    fn webserver_verify_ca_is_a_boolean_or_a_bundle() {
        let tls = |v: &str| {
            Config::load_from(
                &Files::default(),
                &env(&[("OS_DEFAULT__WEBSERVER_VERIFY_CA", v)]),
                &[],
            )
            .unwrap()
            .source_tls()
        };
        assert_eq!(tls("False"), SourceTls::Insecure);
        assert_eq!(tls("n"), SourceTls::Insecure);
        assert_eq!(tls("True"), SourceTls::System);
        assert_eq!(tls("/nonexistent/ca.pem"), SourceTls::System);
        let dir = tempfile::tempdir().unwrap();
        let bundle = dir.path().join("ca.pem");
        std::fs::write(&bundle, "x").unwrap();
        assert_eq!(
            tls(bundle.to_str().unwrap()),
            SourceTls::Bundle(bundle.clone())
        );
        let unset = Config::load_from(&Files::default(), &[], &["source.verify_tls=false".into()]);
        assert_eq!(unset.unwrap().source_tls(), SourceTls::Insecure);
        let toml_bool = Config::load_from(
            &Files::default(),
            &[],
            &["DEFAULT.webserver_verify_ca=false".into()],
        );
        assert_eq!(toml_bool.unwrap().source_tls(), SourceTls::Insecure);
    }

    #[test]
    fn user_info_and_signed_query_parameters_are_masked() {
        assert_eq!(
            redact_url("http://user:pw@host:80/a?x=1#f"),
            "http://***@host:80/a?x=1#f"
        );
        assert_eq!(
            redact_url("https://s3/b/k?X-Amz-Credential=AK&X-Amz-Signature=abc&X-Amz-Expires=60"),
            "https://s3/b/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Expires=60"
        );
        assert_eq!(
            redact_url("http://swift/v1/o?temp_url_sig=s&temp_url_expires=1&flag"),
            "http://swift/v1/o?temp_url_sig=***&temp_url_expires=1&flag"
        );
        assert_eq!(
            redact_url("http://host/a?token=t"),
            "http://host/a?token=***"
        );
        assert_eq!(redact_url("http://host/plain"), "http://host/plain");
        assert_eq!(redact_url("0b1c-glance-id"), "0b1c-glance-id");
    }
}
