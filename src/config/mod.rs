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
//! One file per section, its fields, their defaults and the checks of that
//! section side by side (`default.rs` is `[DEFAULT]`, then `agent`,
//! `deploy`, `pxe`, `conductor`, `amqp`, `http`, `metrics`, `source`,
//! `convert`, `cache`, `glance`, `notifications`, `oci`, `peers`,
//! `json_rpc`, `log`); the [`Config`] that holds them and the checks across
//! sections (this file). The layers and the source of every value
//! (`layers`), turning the layers' values into the typed sections
//! (`value`), the options that take one of a few words, each an enum
//! (`choice`), problems that name an option and its source (`check`), the
//! directories the worker writes checked at start (`dirs`), `config show`
//! (`show`), and reading an existing ironic.conf (`ironic_conf`). Must not
//! know anything else of the worker.
//!
//! A new option is a field of its section (with its default in the
//! section's `Default`, a check in its `check` when it needs one; one of a
//! few words is a `choice!` enum, not a string) and a commented line in
//! `ops/worker.example.toml`; a new section is a file here and a field of
//! [`Config`].

mod agent;
mod amqp;
mod cache;
mod check;
mod choice;
mod conductor;
mod convert;
mod default;
mod deploy;
mod dirs;
mod gather;
mod glance;
mod http;
pub(crate) mod ironic_conf;
mod json_rpc;
mod layers;
mod log;
mod metrics;
mod notifications;
mod oci;
mod origin;
mod peers;
#[cfg(test)]
mod precedence;
mod pxe;
mod show;
mod source;
mod value;

pub use agent::{AgentSection, ImageDownloadSource};
pub use amqp::{AmqpSection, QueueType, SealMode, SslVersion, split_broker_urls};
pub use cache::CacheSection;
pub use check::{Problem, Report, refusal};
pub use choice::{AuthStrategy, TlsMinVersion};
pub use conductor::{BLOCKED_FILE_URL_PATHS, ConductorSection, blocked_dir};
pub use convert::ConvertSection;
pub use default::{DefaultSection, system_hostname};
pub use deploy::DeploySection;
pub use gather::{ENV_PREFIX, Files};
pub use glance::{GlanceAuthType, GlanceSection};
pub use http::{GzipMode, HttpSection};
pub use json_rpc::JsonRpcSection;
pub use layers::{Layers, Raw, Setting};
pub use log::{LogFormat, LogSection};
pub use metrics::MetricsSection;
pub use notifications::NotificationsSection;
pub use oci::OciSection;
pub use origin::Source;
pub use peers::{PeersSection, listener_url};
pub use pxe::{PxeSection, SYSTEM_MASTER_PATH};
pub use source::SourceSection;

use crate::error::Result;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The whole configuration, section by section as in ironic.conf.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
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
    /// `[log]`: the log format and the access log.
    pub log: LogSection,
    /// `[json_rpc]`: the JSON-RPC listener (off unless `listen` is set).
    pub json_rpc: JsonRpcSection,
}

/// A configuration as read: its values, every layer's settings (where
/// each value came from), and what is allowed but worth a warning.
#[derive(Debug)]
pub struct Loaded {
    /// The effective configuration, checked.
    pub config: Config,
    /// Every value of every layer, with its source.
    pub layers: Layers,
    /// What is allowed but likely wrong, each naming its option and source.
    pub warnings: Vec<Problem>,
}

/// Reads and checks the configuration: `files`, the variables of `env`,
/// then `flags` (`section.option=value`). Fails with every problem found,
/// each naming its option and where its value came from.
pub fn read(
    files: &Files,
    env: &[(String, String)],
    flags: &[String],
) -> Result<Loaded, Vec<Problem>> {
    let mut layers = gather::layers(files, env, flags)?;
    let (config, unfit) = value::typed::<Config>(&layers)?;
    let mut report = Report {
        errors: unfit,
        ..Report::default()
    };
    config.check(&mut report);
    if let Some(path) = &layers.ironic_master_path {
        config.check_master_not_ironics(path, &mut report);
    }
    config.check_broker_is_ironics(&layers, &mut report);
    if let Some(interface) = &layers.interface_seal {
        config.amqp.check_seal_matches(interface, &mut report);
    }
    let report = layers.blame(report);
    if !report.errors.is_empty() {
        return Err(report.errors);
    }
    let mut warnings = std::mem::take(&mut layers.warnings);
    warnings.extend(report.warnings);
    warnings.extend(overrides(&layers));
    Ok(Loaded {
        config,
        layers,
        warnings,
    })
}

/// Every option of Ironic's configuration that one of the worker's own
/// settings overrides with another value, as a warning with both values:
/// the worker then disagrees with the conductor it serves.
fn overrides(layers: &Layers) -> Vec<Problem> {
    let shown = |name: &str, s: &Setting| crate::secrets::shown_value(name, &s.value.text());
    layers
        .overridden()
        .into_iter()
        .map(|((section, option), ironic, winner)| Problem {
            option: Some((section.clone(), option.clone())),
            source: winner.source.clone(),
            message: format!(
                "{} overrides {} from {}",
                shown(option, winner),
                shown(option, ironic),
                ironic.source
            ),
        })
        .collect()
}

impl Loaded {
    /// The configuration in force as TOML, each option with its source,
    /// secrets masked (`config show`).
    pub fn show(&self) -> String {
        show::show(&self.config, &self.layers)
    }

    /// Checks that this process can write the directories the worker
    /// writes (before `serve` takes work, and in `config check`): the
    /// problems, each naming its option and source; warnings join
    /// [`Loaded::warnings`].
    pub fn check_dirs(&mut self) -> Vec<Problem> {
        let mut report = Report::default();
        dirs::check_dirs(&self.config, &mut report);
        let report = self.layers.blame(report);
        self.warnings.extend(report.warnings);
        report.errors
    }
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
        let loaded = read(files, env, overrides).map_err(|problems| check::refusal(&problems))?;
        for warning in &loaded.warnings {
            tracing::warn!("{warning}");
        }
        Ok(loaded.config)
    }

    /// Every section's checks, then those across sections.
    fn check(&self, report: &mut Report) {
        self.default.check(report);
        self.deploy.check(report);
        self.pxe.check(report);
        self.conductor.check(report);
        self.amqp.check(report);
        self.http.check(report);
        self.source.check(report);
        self.convert.check(report);
        self.cache.check(report);
        self.peers.check(report);
        self.json_rpc.check(report);
        self.check_without_broker(report);
        self.check_served_dirs(report);
        self.check_published_url(report);
        for (section, option, dir) in [
            (
                "pxe",
                "instance_master_path",
                &self.pxe.instance_master_path,
            ),
            ("pxe", "images_path", &self.pxe.images_path),
            ("deploy", "http_root", &self.deploy.http_root),
        ] {
            if dir.is_relative() {
                report.error(
                    section,
                    option,
                    format!(
                        "{} must be an absolute path (a relative one depends on where the \
                         worker is started)",
                        dir.display()
                    ),
                );
            }
        }
        let factor = self.raw_image_growth_factor();
        if !factor.is_finite() || factor < 1.0 {
            let section = match self.convert.raw_image_growth_factor {
                Some(_) => "convert",
                None => "DEFAULT",
            };
            report.error(
                section,
                "raw_image_growth_factor",
                format!("{factor} must be a number of at least 1.0 (as in Ironic)"),
            );
        }
    }

    /// The master directory and `images_path` must not lie inside
    /// `http_root`: everything there is served by path (masters, sidecars,
    /// lock files, temporaries), not only the published symlinks.
    fn check_served_dirs(&self, report: &mut Report) {
        let root = crate::fsutil::resolve(&self.deploy.http_root);
        for (option, dir) in [
            ("instance_master_path", &self.pxe.instance_master_path),
            ("images_path", &self.pxe.images_path),
        ] {
            if crate::fsutil::resolve(dir).starts_with(&root) {
                report.error(
                    "pxe",
                    option,
                    format!(
                        "{} is inside [deploy]http_root {}, which would serve its files; use a \
                         directory outside it",
                        dir.display(),
                        self.deploy.http_root.display()
                    ),
                );
            }
        }
    }

    /// An image server that speaks only HTTPS is not published as http://,
    /// and a URL on this host's loopback (given, or derived from a wildcard
    /// or loopback listen address), which no node can reach, is worth a
    /// warning.
    fn check_published_url(&self, report: &mut Report) {
        if self.http.tls_enabled() && self.deploy.http_url.starts_with("http://") {
            report.error(
                "deploy",
                "http_url",
                "is http:// but the image server speaks only HTTPS ([http]tls_cert_file is \
                 set); use https://",
            );
        }
        if self.deploy.http_url_is_loopback() {
            report.warn(
                "deploy",
                "http_url",
                format!(
                    "{} is this host's loopback, which no node can reach; set it to this \
                     host's address on the provisioning network",
                    self.deploy.http_url
                ),
            );
        }
        let ip = self.http.listen.ip();
        if self.deploy.http_url.is_empty() && (ip.is_unspecified() || ip.is_loopback()) {
            report.warn(
                "deploy",
                "http_url",
                format!(
                    "unset: nodes are given {}, derived from [http]listen {}, which no node \
                     can reach; set it to this host's address on the provisioning network",
                    self.http_url(),
                    self.http.listen
                ),
            );
        }
    }

    /// Refuses a master directory that is Ironic's own (`ironic`, its
    /// `[pxe]instance_master_path`): Ironic's clean-up deletes every unlinked
    /// file there and its downloads collide with the worker's.
    pub fn check_master_not_ironics(&self, ironic: &Path, report: &mut Report) {
        if crate::fsutil::same_path(&self.pxe.instance_master_path, ironic) {
            report.error(
                "pxe",
                "instance_master_path",
                format!(
                    "{} is Ironic's master image directory; the worker needs a directory of its \
                     own (default {SYSTEM_MASTER_PATH}, on the same file system as \
                     [pxe]images_path)",
                    self.pxe.instance_master_path.display()
                ),
            );
        }
    }

    /// Refuses a broker nobody configured where Ironic has none
    /// (`rpc_transport = json-rpc` or `none`, no `transport_url`): the
    /// worker would retry guest@127.0.0.1 for ever while Ironic calls its
    /// JSON-RPC listener. An `[amqp]url` set anywhere is the operator's
    /// choice and stands.
    fn check_broker_is_ironics(&self, layers: &Layers, report: &mut Report) {
        let Some((transport, source)) = &layers.ironic_rpc_transport else {
            return;
        };
        let brokerless = matches!(transport.as_str(), "json-rpc" | "none");
        if !brokerless || !self.amqp.enabled || !layers.stack("amqp", "url").is_empty() {
            return;
        }
        report.error(
            "amqp",
            "enabled",
            format!(
                "true, but Ironic has no broker (rpc_transport = {transport} from {source}, \
                 no transport_url): set [amqp]enabled = false and [json_rpc]listen (see \
                 \"Without RabbitMQ\" in the operator guide), or [amqp]url"
            ),
        );
    }

    /// With `[amqp]enabled = false` nothing may need the broker: peers
    /// (their queries and claims cross it) are refused, and so is a
    /// request for Ironic's notifications, which only come through it; and
    /// the JSON-RPC listener must be on, or no command could arrive.
    fn check_without_broker(&self, report: &mut Report) {
        if self.amqp.enabled {
            return;
        }
        if self.peers.enabled() {
            report.error(
                "peers",
                "listen",
                "[peers] needs the broker (queries and download claims go through it), but \
                 [amqp]enabled = false: unset [peers]listen or enable [amqp]",
            );
        }
        if self.amqp.bind_notifications == Some(true) {
            report.error(
                "amqp",
                "bind_notifications",
                "true needs the broker (Ironic's notifications come through it), but \
                 [amqp]enabled = false",
            );
        }
        if !self.json_rpc.enabled() {
            report.error(
                "amqp",
                "enabled",
                "false and no [json_rpc]listen: the worker would take no commands at all; set \
                 [json_rpc]listen",
            );
        }
    }

    /// Whether the image server speaks HTTPS.
    pub fn tls_enabled(&self) -> bool {
        self.http.tls_enabled()
    }

    /// `[DEFAULT]raw_image_growth_factor`, or its earlier name
    /// `[convert]raw_image_growth_factor` when that is set.
    pub fn raw_image_growth_factor(&self) -> f64 {
        self.convert
            .raw_image_growth_factor
            .unwrap_or(self.default.raw_image_growth_factor)
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
        let scheme = if self.http.tls_enabled() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{host}:{}", addr.port())
    }
}

/// Directory for the default paths of a worker without configuration
/// files: `$XDG_STATE_HOME/ironic-image-worker`, else
/// `./ironic-image-worker-state` (both writable without root), made
/// absolute so that what `config show` prints is where files go.
pub fn default_state_dir() -> PathBuf {
    let dir = match std::env::var_os("XDG_STATE_HOME") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir).join("ironic-image-worker"),
        _ => PathBuf::from("ironic-image-worker-state"),
    };
    match std::env::current_dir() {
        Ok(cwd) if dir.is_relative() => cwd.join(dir),
        _ => dir,
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

#[cfg(test)]
mod tests {
    use super::{Config, Files, SourceTls};

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

    /// An `http_url` on this host's loopback, given explicitly, is warned
    /// about as the derived one is; an address of the network is not.
    #[test]
    fn a_loopback_http_url_is_warned_about() {
        let warnings = |url: &str| -> Vec<String> {
            let set = [
                format!("deploy.http_url={url}"),
                "http.listen=0.0.0.0:8080".into(),
            ];
            super::read(&Files::default(), &[], &set)
                .unwrap()
                .warnings
                .iter()
                .map(ToString::to_string)
                .filter(|w| w.contains("[deploy]http_url"))
                .collect()
        };
        for url in [
            "http://127.0.0.1:8080",
            "http://localhost:8080/",
            "https://[::1]:8080",
            "http://127.1.2.3",
        ] {
            let w = warnings(url);
            assert!(
                w.len() == 1 && w[0].contains("loopback, which no node can reach"),
                "{url}: {w:?}"
            );
        }
        assert!(warnings("http://192.0.2.10:8080").is_empty());
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
}
