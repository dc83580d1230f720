//! `[json_rpc]`: the JSON-RPC listener, the worker's commands for an
//! Ironic without a broker (Metal3, Bifrost, standalone), with the names
//! Ironic's own JSON-RPC server uses where they exist.

use super::check::Report;
use super::choice::{AuthStrategy, TlsMinVersion};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

/// `[json_rpc]`: off unless `listen` is set.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct JsonRpcSection {
    /// Where the listener binds (`host:port`); unset: no JSON-RPC.
    pub listen: Option<SocketAddr>,
    /// `noauth` or `http_basic` (against `http_basic_auth_user_file`).
    pub auth_strategy: AuthStrategy,
    /// Apache htpasswd file of bcrypt entries (`htpasswd -B`), read again
    /// when it changes.
    pub http_basic_auth_user_file: String,
    /// Certificate chain (PEM); with `tls_key_file` the listener speaks
    /// only HTTPS. Reloaded when the file changes.
    pub tls_cert_file: String,
    /// Private key (PEM) of `tls_cert_file`; never logged.
    pub tls_key_file: String,
    /// Lowest TLS version accepted: `1.3` (the default) or `1.2`.
    pub tls_min_version: TlsMinVersion,
    /// Largest request body read, bytes (a command with a large
    /// `instance_info` is a few KiB).
    pub max_body_bytes: usize,
    /// Connections kept open at once.
    pub max_connections: usize,
    /// Seconds a call waits for its work before it answers
    /// `{"status": "in_progress"}` (then `status` tells the end). Below
    /// the client's own timeout (Ironic's `[<group>]timeout`, 120).
    pub request_timeout: u64,
}

impl Default for JsonRpcSection {
    fn default() -> Self {
        JsonRpcSection {
            listen: None,
            auth_strategy: AuthStrategy::NoAuth,
            http_basic_auth_user_file: String::new(),
            tls_cert_file: String::new(),
            tls_key_file: String::new(),
            tls_min_version: TlsMinVersion::Tls13,
            max_body_bytes: 1 << 20,
            max_connections: 256,
            request_timeout: 60,
        }
    }
}

impl JsonRpcSection {
    /// Whether the listener runs.
    pub fn enabled(&self) -> bool {
        self.listen.is_some()
    }

    /// Whether the listener speaks HTTPS.
    pub fn tls_enabled(&self) -> bool {
        !self.tls_cert_file.is_empty()
    }

    /// Checks a configured listener: the file of `http_basic`, TLS files
    /// given together and readable, bounds above zero.
    pub(super) fn check(&self, report: &mut Report) {
        match self.auth_strategy {
            AuthStrategy::NoAuth => {}
            AuthStrategy::HttpBasic if self.http_basic_auth_user_file.is_empty() => report.error(
                "json_rpc",
                "http_basic_auth_user_file",
                "must be set: auth_strategy http_basic checks against it",
            ),
            AuthStrategy::HttpBasic => {
                if let Err(e) = std::fs::metadata(&self.http_basic_auth_user_file) {
                    report.error(
                        "json_rpc",
                        "http_basic_auth_user_file",
                        format!("{}: {e}", self.http_basic_auth_user_file),
                    );
                }
            }
        }
        report.tls("json_rpc", &self.tls_cert_file, &self.tls_key_file);
        for (option, value) in [
            ("max_body_bytes", self.max_body_bytes as u64),
            ("max_connections", self.max_connections as u64),
            ("request_timeout", self.request_timeout),
        ] {
            if value == 0 {
                report.error("json_rpc", option, "must be above 0");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{Config, Files};

    fn load(set: &[&str]) -> Result<Config, String> {
        let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
        Config::load_from(&Files::default(), &[], &set).map_err(|e| e.message)
    }

    /// Without a broker the worker needs the JSON-RPC listener, and what
    /// only works through a broker is refused naming its option.
    #[test]
    fn without_a_broker_what_needs_one_is_refused_by_name() {
        let off = "amqp.enabled=false";
        let listen = "json_rpc.listen=127.0.0.1:8089";
        assert!(load(&[off]).unwrap_err().contains("[json_rpc]listen"));
        let c = load(&[off, listen]).unwrap();
        assert!(!c.amqp.binds_notifications());
        assert!(
            load(&[]).unwrap().amqp.binds_notifications(),
            "on by default with a broker"
        );
        let peers = load(&[
            off,
            listen,
            "peers.listen=127.0.0.1:9",
            "peers.secret=0123456789abcdef0",
        ]);
        assert!(peers.unwrap_err().contains("[peers]"));
        let bind = load(&[off, listen, "amqp.bind_notifications=true"]);
        assert!(bind.unwrap_err().contains("[amqp]bind_notifications"));
        let basic = load(&[listen, "json_rpc.auth_strategy=http_basic"]);
        assert!(
            basic
                .unwrap_err()
                .contains("[json_rpc]http_basic_auth_user_file")
        );
        let half_tls = load(&[listen, "json_rpc.tls_cert_file=/etc/hostname"]);
        assert!(half_tls.unwrap_err().contains("[json_rpc]tls_cert_file"));
    }

    /// An Ironic without a broker (`rpc_transport = json-rpc`, no
    /// `transport_url`) and a worker left with its default broker: refused,
    /// naming both; a broker chosen, or none, is accepted.
    #[test]
    fn a_default_broker_beside_an_ironic_without_one_is_refused() {
        let env = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let load = |env: &[(String, String)], set: &[&str]| {
            let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
            Config::load_from(&Files::default(), env, &set).map_err(|e| e.message)
        };
        let ironic = env(&[("OS_DEFAULT__RPC_TRANSPORT", "json-rpc")]);
        let refused = load(&ironic, &[]).unwrap_err();
        assert!(
            refused.contains("[amqp]enabled")
                && refused.contains(
                    "rpc_transport = json-rpc from environment OS_DEFAULT__RPC_TRANSPORT"
                ),
            "{refused}"
        );
        let none = env(&[("OS_DEFAULT__RPC_TRANSPORT", "none")]);
        assert!(load(&none, &[]).is_err());
        load(
            &ironic,
            &["amqp.enabled=false", "json_rpc.listen=127.0.0.1:8099"],
        )
        .unwrap();
        load(&ironic, &["amqp.url=amqp://u:p@rabbit:5672/%2F"]).unwrap();
        let with_broker = env(&[
            ("OS_DEFAULT__RPC_TRANSPORT", "json-rpc"),
            ("OS_DEFAULT__TRANSPORT_URL", "rabbit://u:p@rabbit:5672/"),
        ]);
        load(&with_broker, &[]).unwrap();
        load(&env(&[("OS_DEFAULT__RPC_TRANSPORT", "oslo")]), &[]).unwrap();
    }
}
