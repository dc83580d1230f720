//! Reading an existing `ironic.conf` (oslo.config INI syntax), so that the
//! worker takes the options it shares with the conductor from the very file
//! the conductor reads and the two cannot disagree.
//!
//! Only the shared options are taken; the result is the lowest layer of the
//! configuration, below the worker's own TOML file, the environment and
//! `--set` flags. Options the ironic.conf leaves unset get Ironic's defaults
//! where they differ from the worker's own (paths such as `/httpboot`), except
//! `[agent]image_download_source`, which only counts when set explicitly
//! (see docs/contract.md, "Which images are cached").

use super::check::Problem;
use super::layers::{InterfaceSeal, Layers, Raw};
use super::origin::Source;
use crate::error::{Error, ErrorCode, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// Parsed INI: section -> option -> values (oslo multi-valued options may
/// repeat; the last value wins for single-valued ones).
#[derive(Debug, Default, Clone)]
pub struct IniFile {
    sections: BTreeMap<String, BTreeMap<String, Vec<String>>>,
    /// The options oslo.config's environment variables set, with the
    /// variable that set each.
    from_env: BTreeMap<(String, String), String>,
}

/// How an ironic.conf value is turned into a worker option: as text,
/// typed by the option receiving it, or as a list (oslo's `ListOpt`:
/// comma- or line-separated).
#[derive(Clone, Copy)]
enum Kind {
    Text,
    List,
}

/// Options with the same section and name in ironic.conf and the worker.
const SAME: &[(&str, &[(&str, Kind)])] = &[
    (
        "DEFAULT",
        &[
            ("host", Kind::Text),
            ("force_raw_images", Kind::Text),
            // Ironic options that change the image path (docs/contract.md,
            // "Ironic's image options").
            ("raw_image_growth_factor", Kind::Text),
            ("webserver_verify_ca", Kind::Text),
            ("webserver_connection_timeout", Kind::Text),
        ],
    ),
    (
        "agent",
        &[
            ("image_download_source", Kind::Text),
            ("stream_raw_images", Kind::Text),
            ("allow_md5_checksum", Kind::Text),
        ],
    ),
    (
        "deploy",
        &[
            ("http_root", Kind::Text),
            ("http_url", Kind::Text),
            ("http_image_subdir", Kind::Text),
            // The credentials of the user's image servers.
            ("image_server_auth_strategy", Kind::Text),
            ("image_server_user", Kind::Text),
            ("image_server_password", Kind::Text),
            ("image_server_auth_hosts", Kind::List),
            ("image_server_auth_permit_unknown_hosts", Kind::Text),
        ],
    ),
    (
        "pxe",
        &[
            ("images_path", Kind::Text),
            ("image_cache_size", Kind::Text),
            ("image_cache_ttl", Kind::Text),
        ],
    ),
    (
        "conductor",
        &[
            ("permitted_image_formats", Kind::List),
            ("file_url_allowed_paths", Kind::List),
            ("disable_deep_image_inspection", Kind::Text),
            ("disable_support_for_checksum_files", Kind::Text),
            ("conductor_always_validates_images", Kind::Text),
        ],
    ),
    (
        "glance",
        &[
            ("endpoint_override", Kind::Text),
            ("auth_type", Kind::Text),
            ("auth_url", Kind::Text),
            ("username", Kind::Text),
            ("password", Kind::Text),
            ("user_domain_name", Kind::Text),
            ("user_domain_id", Kind::Text),
            ("project_name", Kind::Text),
            ("project_id", Kind::Text),
            ("project_domain_name", Kind::Text),
            ("project_domain_id", Kind::Text),
            ("application_credential_id", Kind::Text),
            ("application_credential_secret", Kind::Text),
            ("token", Kind::Text),
            ("region_name", Kind::Text),
            ("valid_interfaces", Kind::List),
            ("insecure", Kind::Text),
        ],
    ),
    (
        "oci",
        &[
            ("authentication_config", Kind::Text),
            ("verify_ca", Kind::Text),
            ("permit_fallback_to_http_transport", Kind::Text),
            ("secure_cdn_registries", Kind::List),
        ],
    ),
];

/// ironic.conf options the worker keeps under another name:
/// (ironic.conf section, option, worker section, worker option, kind).
const RENAMED: &[(&str, &str, &str, &str, Kind)] = &[
    (
        "DEFAULT",
        "control_exchange",
        "amqp",
        "notification_exchange",
        Kind::Text,
    ),
    (
        "oslo_messaging_notifications",
        "topics",
        "amqp",
        "notification_topics",
        Kind::List,
    ),
    (
        "oslo_messaging_rabbit",
        "ssl_ca_file",
        "amqp",
        "ssl_ca_file",
        Kind::Text,
    ),
    (
        "oslo_messaging_rabbit",
        "ssl_cert_file",
        "amqp",
        "ssl_cert_file",
        Kind::Text,
    ),
    (
        "oslo_messaging_rabbit",
        "ssl_key_file",
        "amqp",
        "ssl_key_file",
        Kind::Text,
    ),
    (
        "oslo_messaging_rabbit",
        "ssl_version",
        "amqp",
        "ssl_version",
        Kind::Text,
    ),
    (
        "oslo_messaging_rabbit",
        "amqp_durable_queues",
        "amqp",
        "notification_exchange_durable",
        Kind::Text,
    ),
];

/// Ironic's defaults for the path options, used when the ironic.conf does not
/// set them (the worker's own defaults are root-free paths instead).
const IRONIC_DEFAULTS: &[(&str, &str, &str)] = &[
    ("deploy", "http_root", "/httpboot"),
    ("pxe", "images_path", "/var/lib/ironic/images/"),
    ("conductor", "file_url_allowed_paths", "/var/lib/ironic"),
    ("DEFAULT", "state_path", "/var/lib/ironic"),
];

impl IniFile {
    /// Parses oslo.config INI text: `[section]`, `key = value` or
    /// `key: value`, `#`/`;` comment lines, indented continuation lines,
    /// values in matching quotes unquoted, repeated keys kept in order.
    pub fn parse(text: &str) -> Result<IniFile> {
        let mut ini = IniFile::default();
        let mut section: Option<String> = None;
        let mut last: Option<(String, String)> = None;
        for (n, raw) in text.lines().enumerate() {
            let line = raw.trim_end();
            let trimmed = line.trim_start();
            if trimmed.is_empty() || trimmed.starts_with('#') || trimmed.starts_with(';') {
                continue;
            }
            let bad = |what: &str| conf_error(format!("line {}: {what}", n + 1));
            if line.starts_with([' ', '\t']) {
                let (s, k) = last
                    .as_ref()
                    .ok_or_else(|| bad("continuation of nothing"))?;
                if let Some(v) = ini.values_mut(s, k).last_mut() {
                    v.push('\n');
                    v.push_str(trimmed);
                }
                continue;
            }
            if let Some(name) = trimmed.strip_prefix('[') {
                let name = name
                    .strip_suffix(']')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .ok_or_else(|| bad("bad section header"))?;
                section = Some(name.to_string());
                last = None;
                continue;
            }
            let sec = section
                .clone()
                .ok_or_else(|| bad("option before any section"))?;
            let split = trimmed
                .find(['=', ':'])
                .ok_or_else(|| bad("expected `name = value`"))?;
            let key = trimmed[..split].trim().to_string();
            if key.is_empty() {
                return Err(bad("empty option name"));
            }
            let value = unquote(trimmed[split + 1..].trim()).to_string();
            ini.values_mut(&sec, &key).push(value);
            last = Some((sec, key));
        }
        Ok(ini)
    }

    fn values_mut(&mut self, section: &str, key: &str) -> &mut Vec<String> {
        self.sections
            .entry(section.to_string())
            .or_default()
            .entry(key.to_string())
            .or_default()
    }

    /// The raw (last) value of an option, before `$name` substitution.
    pub fn raw(&self, section: &str, key: &str) -> Option<&str> {
        self.sections
            .get(section)?
            .get(key)?
            .last()
            .map(String::as_str)
    }

    /// The value with oslo.config's `$name` / `${name}` / `${group.name}`
    /// substitution (from the same section, then `[DEFAULT]`, then Ironic's
    /// defaults), `$$` for a literal `$`.
    pub fn get(&self, section: &str, key: &str) -> Result<Option<String>> {
        match self.raw(section, key) {
            None => Ok(None),
            Some(v) => self.substitute(section, v, 0).map(Some),
        }
    }

    fn lookup(&self, section: &str, name: &str, depth: u32) -> Result<String> {
        let (section, name) = match name.split_once('.') {
            Some((group, opt)) => (group, opt),
            None => (section, name),
        };
        let value = self
            .raw(section, name)
            .or_else(|| self.raw("DEFAULT", name))
            .or_else(|| ironic_default(section, name))
            .or_else(|| ironic_default("DEFAULT", name))
            .ok_or_else(|| conf_error(format!("${name}: no such option to substitute")))?;
        self.substitute(section, value, depth + 1)
    }

    fn substitute(&self, section: &str, value: &str, depth: u32) -> Result<String> {
        if depth > 10 {
            return Err(conf_error(format!("{value:?}: substitution loop")));
        }
        let mut out = String::new();
        let mut rest = value;
        while let Some(at) = rest.find('$') {
            out.push_str(&rest[..at]);
            let after = &rest[at + 1..];
            if let Some(tail) = after.strip_prefix('$') {
                out.push('$');
                rest = tail;
            } else if let Some(braced) = after.strip_prefix('{') {
                let end = braced
                    .find('}')
                    .ok_or_else(|| conf_error(format!("{value:?}: unclosed ${{")))?;
                out.push_str(&self.lookup(section, &braced[..end], depth)?);
                rest = &braced[end + 1..];
            } else {
                let end = after
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(after.len());
                if end == 0 {
                    out.push('$');
                } else {
                    out.push_str(&self.lookup(section, &after[..end], depth)?);
                }
                rest = &after[end..];
            }
        }
        out.push_str(rest);
        Ok(out)
    }
}

fn ironic_default(section: &str, key: &str) -> Option<&'static str> {
    IRONIC_DEFAULTS
        .iter()
        .find(|(s, k, _)| *s == section && *k == key)
        .map(|(_, _, v)| *v)
}

fn unquote(v: &str) -> &str {
    for q in ['"', '\''] {
        if v.len() >= 2 && v.starts_with(q) && v.ends_with(q) {
            return &v[1..v.len() - 1];
        }
    }
    v
}

/// An error of the ironic.conf read (its source is named by the caller).
fn conf_error(message: String) -> Error {
    Error::new(ErrorCode::Internal, message)
}

fn parse_bool(section: &str, key: &str, v: &str) -> Result<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "true" | "yes" | "on" | "1" => Ok(true),
        "false" | "no" | "off" | "0" => Ok(false),
        _ => Err(conf_error(format!(
            "[{section}]{key}: {v:?} is not a boolean"
        ))),
    }
}

/// Turns an oslo.messaging `transport_url`
/// (`rabbit://user:pass@host:port[,user:pass@host2:port]/vhost?ssl=1`) into
/// the worker's AMQP URLs: one per host, each with its own credentials, the
/// virtual host, and `amqps` when `ssl` (or `?ssl=1`) asks for TLS. The
/// worker tries them in turn, as oslo.messaging fails over between them.
pub fn amqp_url_from_transport(transport: &str, ssl: bool) -> Result<Vec<String>> {
    let (scheme, rest) = transport
        .split_once("://")
        .ok_or_else(|| conf_error("[DEFAULT]transport_url: not a URL".into()))?;
    if !matches!(scheme, "rabbit" | "amqp" | "kombu+rabbit") {
        return Err(conf_error(format!(
            "[DEFAULT]transport_url: scheme {scheme:?} is not RabbitMQ (rabbit://)"
        )));
    }
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, ""),
    };
    let (path, query) = path.split_once('?').unwrap_or((path, ""));
    let ssl = ssl
        || query.split('&').any(|kv| {
            matches!(
                kv.split_once('='),
                Some(("ssl", v)) if parse_bool("DEFAULT", "transport_url", v).unwrap_or(false)
            )
        });
    // oslo.messaging: an empty virtual host is the broker's default, "/".
    let vhost = if path.is_empty() { "%2F" } else { path };
    let scheme = if ssl { "amqps" } else { "amqp" };
    authority
        .split(',')
        .map(str::trim)
        .map(|host| {
            if host.is_empty() || host.ends_with('@') {
                Err(conf_error("[DEFAULT]transport_url: an empty host".into()))
            } else {
                Ok(format!("{scheme}://{host}/{vhost}"))
            }
        })
        .collect()
}

/// Prefix of oslo.config's environment source: `OS_<GROUP>__<OPTION>`,
/// group and option upper-cased (`OS_DEFAULT__HOST`,
/// `OS_AGENT__ALLOW_MD5_CHECKSUM`), as Metal3 configures Ironic.
pub const OSLO_ENV_PREFIX: &str = "OS_";

/// Options read from ironic.conf beside the shared ones (the broker, the
/// path substitutions, Ironic's master directory).
const OTHER_READ: &[(&str, &str)] = &[
    ("DEFAULT", "transport_url"),
    ("DEFAULT", "rpc_transport"),
    ("DEFAULT", "state_path"),
    ("oslo_messaging_rabbit", "ssl"),
    ("oslo_messaging_notifications", "transport_url"),
    ("pxe", "instance_master_path"),
    ("image_worker", "seal_secret_file"),
    ("image_worker", "seal"),
    ("image_worker", "transport"),
];

/// The deploy interface's seal settings in `ini`.
fn interface_seal(ini: &IniFile, file: Option<&Path>) -> Result<InterfaceSeal> {
    let set = |key| -> Result<Option<String>> {
        Ok(ini
            .get("image_worker", key)?
            .filter(|v| !v.trim().is_empty()))
    };
    Ok(InterfaceSeal {
        secret_file: set("seal_secret_file")?,
        mode: set("seal")?,
        over_broker: set("transport")?.is_none_or(|t| t.trim() != "json-rpc"),
        source: ini.source(file, "image_worker", "seal_secret_file"),
    })
}

/// The environment variable oslo.config reads for `[group]option`.
pub fn oslo_env_name(group: &str, option: &str) -> String {
    format!(
        "{OSLO_ENV_PREFIX}{}__{}",
        group.to_ascii_uppercase(),
        option.to_ascii_uppercase()
    )
}

/// Every option the worker takes from Ironic's configuration under the
/// same or another name: (ironic.conf section, option, worker section,
/// worker option, kind). `[DEFAULT]transport_url` is read apart
/// ([`map_transport`]: one value becomes a list of URLs).
fn shared_options()
-> impl Iterator<Item = (&'static str, &'static str, &'static str, &'static str, Kind)> {
    let same = SAME.iter().flat_map(|(sec, opts)| {
        opts.iter()
            .map(move |&(key, kind)| (*sec, key, *sec, key, kind))
    });
    same.chain(RENAMED.iter().copied())
}

/// An option's section and name, as written in its file.
#[cfg(test)]
pub(super) type OptionName = (&'static str, &'static str);

/// Every option the worker shares with Ironic, as ((ironic.conf section,
/// option), (worker section, option)): the options whose precedence the
/// configuration's tests check layer by layer, so a new one cannot slip.
#[cfg(test)]
pub(super) fn shared_names() -> Vec<(OptionName, OptionName)> {
    shared_options()
        .map(|(isec, ikey, wsec, wkey, _)| ((isec, ikey), (wsec, wkey)))
        .chain([(("DEFAULT", "transport_url"), ("amqp", "url"))])
        .collect()
}

impl IniFile {
    /// Sets over the file's values those of oslo.config's environment
    /// source, for every option the worker reads of ironic.conf: as in
    /// oslo.config, `OS_<GROUP>__<OPTION>` wins over the file. Other `OS_`
    /// variables (an OpenStack client's `OS_AUTH_URL`...) are not read.
    /// Returns how many were taken.
    pub fn overlay_env(&mut self, env: &[(String, String)]) -> usize {
        let shared = shared_options().map(|(sec, key, ..)| (sec, key));
        let mut taken = 0;
        for (sec, key) in shared.chain(OTHER_READ.iter().copied()) {
            let name = oslo_env_name(sec, key);
            if let Some((_, value)) = env.iter().rev().find(|(n, _)| *n == name) {
                *self.values_mut(sec, key) = vec![value.clone()];
                self.from_env
                    .insert((sec.to_string(), key.to_string()), name);
                taken += 1;
            }
        }
        taken
    }

    /// Where `[section] key` was read: its variable, or its line in `file`.
    fn source(&self, file: Option<&Path>, section: &str, key: &str) -> Source {
        match (
            self.from_env.get(&(section.to_string(), key.to_string())),
            file,
        ) {
            (Some(name), _) => Source::OsloEnv(name.clone()),
            (None, Some(file)) => Source::IronicConf {
                file: file.to_path_buf(),
                option: format!("[{section}]{key}"),
            },
            (None, None) => Source::Default,
        }
    }
}

/// Reads the ironic.conf at `path` (when given) and the `OS_` variables of
/// `env` into the lowest layer of the worker's configuration. Without a
/// file, only the options the variables set are taken (none of Ironic's
/// path defaults).
pub fn load(path: Option<&Path>, env: &[(String, String)]) -> Result<Layers, Problem> {
    let whole = |e: Error| {
        let source = match path {
            Some(file) => Source::IronicConf {
                file: file.to_path_buf(),
                option: String::new(),
            },
            None => Source::OsloEnv(format!("{OSLO_ENV_PREFIX}*")),
        };
        Problem::of_source(source, e.message)
    };
    let mut ini = match path {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| conf_error(format!("cannot read it: {e}")))
                .map_err(whole)?;
            IniFile::parse(&text).map_err(whole)?
        }
        None => IniFile::default(),
    };
    let from_env = ini.overlay_env(env);
    let mut layers = Layers::default();
    if path.is_none() && from_env == 0 {
        return Ok(layers);
    }
    let master_path = match ini.get("pxe", "instance_master_path").map_err(whole)? {
        Some(v) => Some(v),
        None if path.is_some() => Some(
            ini.substitute("pxe", "$state_path/master_images", 0)
                .map_err(whole)?,
        ),
        None => None,
    };
    layers.ironic_master_path = master_path.map(std::path::PathBuf::from);
    if let Some(transport) = ini.get("DEFAULT", "rpc_transport").map_err(whole)? {
        let source = ini.source(path, "DEFAULT", "rpc_transport");
        layers.ironic_rpc_transport = Some((transport.trim().to_string(), source));
    }
    let names_seal = ["seal_secret_file", "seal"]
        .iter()
        .any(|key| ini.raw("image_worker", key).is_some());
    if path.is_some() || names_seal {
        layers.interface_seal = Some(interface_seal(&ini, path).map_err(whole)?);
    }
    map_options(&ini, path, &mut layers).map_err(whole)?;
    Ok(layers)
}

/// Maps the shared options of a parsed ironic.conf to the worker's options;
/// a whole `file` adds what a real ironic.conf implies beyond its lines
/// (Ironic's path defaults, the worker's own master directory), which
/// options from the environment alone do not.
fn map_options(ini: &IniFile, file: Option<&Path>, layers: &mut Layers) -> Result<()> {
    // The worker's masters never live in Ironic's `[pxe]instance_master_path`
    // (Ironic's clean-up deletes every unlinked file there): that option is
    // not taken from ironic.conf.
    if let Some(file) = file {
        let implied = Source::FileDefault(file.to_path_buf());
        let master = crate::config::SYSTEM_MASTER_PATH.to_string();
        layers.set(
            "pxe",
            "instance_master_path",
            Raw::Text(master),
            implied.clone(),
        );
        for (section, key, value) in IRONIC_DEFAULTS {
            if *section != "DEFAULT" && ini.raw(section, key).is_none() {
                layers.set(
                    section,
                    key,
                    Raw::Text((*value).to_string()),
                    implied.clone(),
                );
            }
        }
    }
    for (isec, ikey, wsec, wkey, kind) in shared_options() {
        let Some(v) = ini.get(isec, ikey)? else {
            continue;
        };
        let value = match kind {
            Kind::Text => Raw::Text(v),
            Kind::List => Raw::Toml(toml::Value::Array(
                v.split([',', '\n'])
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(|s| toml::Value::String(s.to_string()))
                    .collect(),
            )),
        };
        layers.set(wsec, wkey, value, ini.source(file, isec, ikey));
    }
    map_transport(ini, file, layers)
}

/// `[DEFAULT]transport_url` (with `[oslo_messaging_rabbit]ssl`) as the
/// worker's `[amqp]url`.
fn map_transport(ini: &IniFile, file: Option<&Path>, layers: &mut Layers) -> Result<()> {
    if let Some(transport) = ini.get("DEFAULT", "transport_url")? {
        let ssl = match ini.get("oslo_messaging_rabbit", "ssl")? {
            Some(v) => parse_bool("oslo_messaging_rabbit", "ssl", &v)?,
            None => false,
        };
        let urls = amqp_url_from_transport(&transport, ssl)?;
        let urls = toml::Value::Array(urls.into_iter().map(toml::Value::String).collect());
        let source = ini.source(file, "DEFAULT", "transport_url");
        layers.set("amqp", "url", Raw::Toml(urls), source);
    }
    if let Some(other) = ini.get("oslo_messaging_notifications", "transport_url")?
        && Some(&other) != ini.get("DEFAULT", "transport_url")?.as_ref()
    {
        layers.warnings.push(Problem::of_source(
            ini.source(file, "oslo_messaging_notifications", "transport_url"),
            "names another broker; the worker listens on [DEFAULT]transport_url only \
             (set [amqp]url to choose)"
                .into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_oslo_syntax() {
        let ini = IniFile::parse(
            "# comment\n[DEFAULT]\nhost = cond-1\nstate_path=/srv/ironic\n; other\n\
             [pxe]\nimages_path = $state_path/images\ninstance_master_path: ${DEFAULT.state_path}/m\n\
             [conductor]\npermitted_image_formats = raw,\n  qcow2\nprice = '$$5'\n",
        )
        .unwrap();
        assert_eq!(ini.get("DEFAULT", "host").unwrap().unwrap(), "cond-1");
        assert_eq!(
            ini.get("pxe", "images_path").unwrap().unwrap(),
            "/srv/ironic/images"
        );
        assert_eq!(
            ini.get("pxe", "instance_master_path").unwrap().unwrap(),
            "/srv/ironic/m"
        );
        assert_eq!(
            ini.get("conductor", "permitted_image_formats")
                .unwrap()
                .unwrap(),
            "raw,\nqcow2"
        );
        assert_eq!(ini.get("conductor", "price").unwrap().unwrap(), "$5");
        assert!(IniFile::parse("host = x\n").is_err());
        assert!(IniFile::parse("[a\n").is_err());
    }

    #[test]
    fn transport_url_becomes_amqp_url() {
        let t = |u, ssl| amqp_url_from_transport(u, ssl).unwrap();
        assert_eq!(
            t("rabbit://ironic:s3cret@10.0.0.5:5672/", false),
            ["amqp://ironic:s3cret@10.0.0.5:5672/%2F"]
        );
        assert_eq!(
            t("rabbit://u:p@a:5671,v:q@b:5671,w:r@c/ironic?ssl=1", false),
            [
                "amqps://u:p@a:5671/ironic",
                "amqps://v:q@b:5671/ironic",
                "amqps://w:r@c/ironic"
            ]
        );
        assert_eq!(t("rabbit://u:p@a", true), ["amqps://u:p@a/%2F"]);
        assert!(amqp_url_from_transport("kafka://x/", false).is_err());
        assert!(amqp_url_from_transport("rabbit://u:p@a,,u:p@b/", false).is_err());
    }

    #[test]
    fn unset_paths_take_ironic_defaults() {
        let ini = IniFile::parse("[DEFAULT]\nhost = c\n").unwrap();
        let file = Path::new("/etc/ironic/ironic.conf");
        let mut layers = Layers::default();
        map_options(&ini, Some(file), &mut layers).unwrap();
        let http_root = layers.stack("deploy", "http_root");
        assert_eq!(http_root[0].value, Raw::Text("/httpboot".into()));
        assert_eq!(http_root[0].source, Source::FileDefault(file.into()));
        assert!(
            layers.stack("agent", "image_download_source").is_empty(),
            "image_download_source only when set"
        );
        assert_eq!(
            layers.source_of("DEFAULT", "host"),
            Source::IronicConf {
                file: file.into(),
                option: "[DEFAULT]host".into()
            }
        );
    }

    #[test]
    fn oslo_variables_are_their_own_source() {
        let mut ini = IniFile::parse("[DEFAULT]\nhost = c\n").unwrap();
        ini.overlay_env(&[("OS_DEFAULT__HOST".into(), "d".into())]);
        let mut layers = Layers::default();
        map_options(&ini, Some(Path::new("/x.conf")), &mut layers).unwrap();
        assert_eq!(
            layers.source_of("DEFAULT", "host"),
            Source::OsloEnv("OS_DEFAULT__HOST".into())
        );
    }
}
