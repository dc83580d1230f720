//! The layers of the configuration and where each value came from.
//!
//! Every layer gives values to options, lowest precedence first: the
//! built-in defaults (no entry here), what the worker reads of Ironic's own
//! configuration (an ironic.conf, then oslo.config's `OS_<GROUP>__<OPTION>`
//! variables), the worker's TOML file, `IRONIC_IMAGE_WORKER__<SECTION>__<OPTION>`
//! variables, then `--set section.option=value` flags. Each option keeps
//! every value it was given with its [`Source`], so the effective value is
//! the last one, `config show` can say where it came from, and an option of
//! the worker's own file that overrides ironic.conf's can be reported with
//! both values.
//!
//! A value from the TOML file is typed by TOML; a value from the
//! environment, a flag or ironic.conf is text, typed by the option that
//! receives it (`value.rs`), so `PASSWORD=123456` stays a string and
//! `IMAGE_CACHE_SIZE=100` is a number without any guessing here.

use super::check::Problem;
use super::ironic_conf;
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

/// Prefix of the environment variables that override configuration options.
pub const ENV_PREFIX: &str = "IRONIC_IMAGE_WORKER__";

/// Where an option's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The worker's built-in default.
    Default,
    /// A default that holds because a configuration file is read: Ironic's
    /// own for an option an ironic.conf leaves unset (`/httpboot`...), or
    /// the worker's system directories (`/var/lib/ironic-image-worker`).
    FileDefault(PathBuf),
    /// A line of an ironic.conf, named as ironic.conf names it
    /// (`[DEFAULT]transport_url`).
    IronicConf {
        /// The ironic.conf read.
        file: PathBuf,
        /// `[section]option` as written in that file.
        option: String,
    },
    /// oslo.config's `OS_<GROUP>__<OPTION>` environment variable.
    OsloEnv(String),
    /// The worker's TOML file.
    Toml(PathBuf),
    /// An `IRONIC_IMAGE_WORKER__<SECTION>__<OPTION>` environment variable.
    Env(String),
    /// A `--set section.option=value` flag.
    Flag(String),
}

impl Source {
    /// The layer's precedence, the one order of the documented layers:
    /// defaults < ironic.conf (with the defaults a read file implies) <
    /// `OS_<GROUP>__<OPTION>` < the worker's TOML file <
    /// `IRONIC_IMAGE_WORKER__*` < `--set`.
    fn rank(&self) -> u8 {
        match self {
            Source::Default => 0,
            Source::FileDefault(_) => 1,
            Source::IronicConf { .. } => 2,
            Source::OsloEnv(_) => 3,
            Source::Toml(_) => 4,
            Source::Env(_) => 5,
            Source::Flag(_) => 6,
        }
    }

    /// Whether the value comes from Ironic's configuration (ironic.conf or
    /// oslo.config's variables) rather than the worker's own settings.
    pub fn is_ironics(&self) -> bool {
        matches!(self, Source::IronicConf { .. } | Source::OsloEnv(_))
    }

    /// Whether the value is one of the worker's own settings (its file,
    /// its environment variables, a flag).
    pub fn is_workers(&self) -> bool {
        matches!(self, Source::Toml(_) | Source::Env(_) | Source::Flag(_))
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => f.write_str("default"),
            Source::FileDefault(file) => write!(f, "default with {}", file.display()),
            Source::IronicConf { file, option } if option.is_empty() => {
                write!(f, "{}", file.display())
            }
            Source::IronicConf { file, option } => write!(f, "{} {option}", file.display()),
            Source::OsloEnv(name) | Source::Env(name) => write!(f, "environment {name}"),
            Source::Toml(file) => write!(f, "{}", file.display()),
            Source::Flag(name) => write!(f, "--set {name}"),
        }
    }
}

/// One value as a layer gives it.
#[derive(Debug, Clone, PartialEq)]
pub enum Raw {
    /// Typed by its layer (the TOML file; ironic.conf's lists).
    Toml(toml::Value),
    /// Text, typed by the option receiving it.
    Text(String),
}

impl Raw {
    /// The value as text, for logs and `config show` (lists joined with
    /// `, `); secrets are masked by the caller.
    pub fn text(&self) -> String {
        match self {
            Raw::Text(t) => t.trim().to_string(),
            Raw::Toml(toml::Value::String(s)) => s.clone(),
            Raw::Toml(toml::Value::Array(items)) => items
                .iter()
                .map(|v| Raw::Toml(v.clone()).text())
                .collect::<Vec<_>>()
                .join(", "),
            Raw::Toml(other) => other.to_string(),
        }
    }
}

/// A value with its source.
#[derive(Debug, Clone, PartialEq)]
pub struct Setting {
    /// The value.
    pub value: Raw,
    /// Where it came from.
    pub source: Source,
}

/// An option's name: its section (`DEFAULT`, `amqp`, ...) and its own.
pub type OptionName = (String, String);

/// Every value every layer gave, option by option, in precedence order.
#[derive(Debug, Clone, Default)]
pub struct Layers {
    options: BTreeMap<OptionName, Vec<Setting>>,
    /// Ironic's `[pxe]instance_master_path` when an ironic.conf (or
    /// oslo.config's variables) names it, which the worker must not share.
    pub ironic_master_path: Option<PathBuf>,
    /// Ironic's `[DEFAULT]rpc_transport` when an ironic.conf (or
    /// `OS_DEFAULT__RPC_TRANSPORT`) sets it, with where: `json-rpc` or
    /// `none` means Ironic has no broker the worker could share.
    pub ironic_rpc_transport: Option<(String, Source)>,
    /// What the ironic.conf read says of the deploy interface's seal
    /// (`[image_worker]`), to compare with the worker's.
    pub interface_seal: Option<super::ironic_conf::InterfaceSeal>,
    /// Notes of the layers themselves (an ironic.conf option the worker
    /// reads differently).
    pub warnings: Vec<Problem>,
}

/// The configuration files to read, lowest precedence first.
#[derive(Debug, Clone, Default)]
pub struct Files {
    /// An existing ironic.conf: the options shared with the conductor.
    pub ironic_conf: Option<PathBuf>,
    /// The worker's own TOML file.
    pub toml: Option<PathBuf>,
}

impl Layers {
    /// Reads every layer: `files`, the `env` variables of both prefixes,
    /// then `flags` (`section.option=value`). A layer that cannot be read
    /// (a missing or malformed file, a malformed name) is a problem.
    pub fn read(
        files: &Files,
        env: &[(String, String)],
        flags: &[String],
    ) -> Result<Layers, Vec<Problem>> {
        let mut layers = ironic_conf::load(files.ironic_conf.as_deref(), env)
            .map_err(|problem| vec![problem])?;
        let mut problems = Vec::new();
        if let Some(path) = &files.toml {
            if files.ironic_conf.is_none() {
                layers.add_system_dirs(path);
            }
            if let Err(problem) = layers.add_toml(path) {
                problems.push(problem);
            }
        }
        for (name, value) in env {
            if let Some(rest) = name.strip_prefix(ENV_PREFIX) {
                let source = Source::Env(name.clone());
                match rest.split_once("__") {
                    Some((section, key)) => layers.set(
                        &env_section(section),
                        &key.to_ascii_lowercase(),
                        Raw::Text(value.clone()),
                        source,
                    ),
                    None => problems.push(Problem::of_source(
                        source,
                        format!("expected {ENV_PREFIX}<SECTION>__<OPTION>"),
                    )),
                }
            }
        }
        for item in flags {
            let parsed = item
                .split_once('=')
                .and_then(|(path, value)| Some((path.split_once('.')?, value)));
            match parsed {
                Some(((section, key), value)) => layers.set(
                    section,
                    key,
                    Raw::Text(flag_text(value)),
                    Source::Flag(format!("{section}.{key}")),
                ),
                None => problems.push(Problem::of_source(
                    Source::Flag(item.split('=').next().unwrap_or_default().to_string()),
                    "expected SECTION.OPTION=VALUE".into(),
                )),
            }
        }
        match problems.is_empty() {
            true => Ok(layers),
            false => Err(problems),
        }
    }

    /// The directories of a worker configured by its own file alone: the
    /// system ones, never the no-configuration state directory (relative to
    /// wherever the worker was started).
    fn add_system_dirs(&mut self, file: &Path) {
        let source = Source::FileDefault(file.to_path_buf());
        for (section, key, dir) in [
            ("pxe", "instance_master_path", super::SYSTEM_MASTER_PATH),
            ("pxe", "images_path", super::pxe::SYSTEM_IMAGES_PATH),
            ("deploy", "http_root", super::deploy::SYSTEM_HTTP_ROOT),
        ] {
            self.set(section, key, Raw::Text(dir.to_string()), source.clone());
        }
    }

    /// Adds the worker's TOML file: every `[section] option = value`.
    fn add_toml(&mut self, path: &Path) -> Result<(), Problem> {
        let source = Source::Toml(path.to_path_buf());
        let text = std::fs::read_to_string(path)
            .map_err(|e| Problem::of_source(source.clone(), format!("cannot read it: {e}")))?;
        let table = text
            .parse::<toml::Table>()
            .map_err(|e| Problem::of_source(source.clone(), e.to_string()))?;
        for (section, options) in table {
            match options {
                toml::Value::Table(options) => {
                    for (key, value) in options {
                        self.set(&section, &key, Raw::Toml(value), source.clone());
                    }
                }
                _ => {
                    return Err(Problem::of_source(
                        source,
                        format!("{section} must be a section ([{section}]), not a value"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Gives `[section] key` a value over the ones it had from layers of
    /// the same or a lower precedence, and under those of a higher one:
    /// the stack stays in precedence order ([`Source::rank`]) whatever
    /// order the layers are read in.
    pub fn set(&mut self, section: &str, key: &str, value: Raw, source: Source) {
        let stack = self
            .options
            .entry((section.to_string(), key.to_string()))
            .or_default();
        let at = stack.partition_point(|s| s.source.rank() <= source.rank());
        stack.insert(at, Setting { value, source });
    }

    /// The effective value of every option a layer set: the last one.
    pub fn effective(&self) -> impl Iterator<Item = (&OptionName, &Setting)> {
        self.options
            .iter()
            .filter_map(|(name, stack)| Some((name, stack.last()?)))
    }

    /// Every value `[section] key` was given, lowest precedence first.
    pub fn stack(&self, section: &str, key: &str) -> &[Setting] {
        self.options
            .get(&(section.to_string(), key.to_string()))
            .map(Vec::as_slice)
            .unwrap_or_default()
    }

    /// Where the effective value of `[section] key` came from.
    pub fn source_of(&self, section: &str, key: &str) -> Source {
        self.stack(section, key)
            .last()
            .map(|s| s.source.clone())
            .unwrap_or(Source::Default)
    }

    /// The options whose value from Ironic's configuration is overridden
    /// by a different one of the worker's own: (option, Ironic's setting,
    /// the winning setting).
    pub fn overridden(&self) -> Vec<(&OptionName, &Setting, &Setting)> {
        let mut out = Vec::new();
        for (name, stack) in &self.options {
            let Some(winner) = stack.last().filter(|s| s.source.is_workers()) else {
                continue;
            };
            let ironic = stack.iter().rev().find(|s| s.source.is_ironics());
            if let Some(ironic) = ironic
                && ironic.value.text() != winner.value.text()
            {
                out.push((name, ironic, winner));
            }
        }
        out
    }
}

/// The text of a `--set` value: as typed, or, when typed as a TOML string
/// (`amqp.url="amqp://..."`, as in the worker's file), the string it
/// quotes; the quotes would otherwise be part of the value.
fn flag_text(value: &str) -> String {
    let quoted = value.len() >= 2
        && ((value.starts_with('"') && value.ends_with('"'))
            || (value.starts_with('\'') && value.ends_with('\'')));
    let parsed = quoted
        .then(|| format!("v = {value}").parse::<toml::Table>().ok())
        .flatten();
    match parsed.as_ref().and_then(|t| t.get("v")) {
        Some(toml::Value::String(text)) => text.clone(),
        _ => value.to_string(),
    }
}

/// The section an environment variable names: `DEFAULT` as written, the
/// others in lower case (`AMQP` is `[amqp]`).
fn env_section(section: &str) -> String {
    match section {
        "DEFAULT" => section.to_string(),
        other => other.to_ascii_lowercase(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn each_value_keeps_its_source_and_the_last_wins() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("w.toml");
        std::fs::write(&file, "[pxe]\nimage_cache_size = 100\n").unwrap();
        let files = Files {
            ironic_conf: None,
            toml: Some(file.clone()),
        };
        let layers = Layers::read(
            &files,
            &env(&[("IRONIC_IMAGE_WORKER__PXE__IMAGE_CACHE_SIZE", "200")]),
            &["pxe.image_cache_size=300".into()],
        )
        .unwrap();
        let stack = layers.stack("pxe", "image_cache_size");
        assert_eq!(stack.len(), 3);
        assert_eq!(stack[0].source, Source::Toml(file));
        assert_eq!(
            stack[1].source,
            Source::Env("IRONIC_IMAGE_WORKER__PXE__IMAGE_CACHE_SIZE".into())
        );
        assert_eq!(
            layers.source_of("pxe", "image_cache_size"),
            Source::Flag("pxe.image_cache_size".into())
        );
        assert_eq!(layers.source_of("pxe", "image_cache_ttl"), Source::Default);
    }

    #[test]
    fn a_flag_typed_as_a_toml_string_is_the_string_it_quotes() {
        let layers = Layers::read(
            &Files::default(),
            &[],
            &[
                r#"amqp.url="amqp://admin:pw@rabbit:5672/ironic""#.into(),
                "DEFAULT.host='cond-1'".into(),
                r#"deploy.http_url="unclosed"#.into(),
                "conductor.permitted_image_formats=raw,qcow2".into(),
            ],
        )
        .unwrap();
        let text = |s: &str, k: &str| layers.stack(s, k)[0].value.text();
        assert_eq!(text("amqp", "url"), "amqp://admin:pw@rabbit:5672/ironic");
        assert_eq!(text("DEFAULT", "host"), "cond-1");
        assert_eq!(text("deploy", "http_url"), "\"unclosed");
        assert_eq!(text("conductor", "permitted_image_formats"), "raw,qcow2");
    }

    #[test]
    fn malformed_names_are_problems_naming_their_source() {
        let problems = Layers::read(
            &Files::default(),
            &env(&[("IRONIC_IMAGE_WORKER__HOST", "x")]),
            &["nodot=1".into()],
        )
        .unwrap_err();
        let lines: Vec<String> = problems.iter().map(ToString::to_string).collect();
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[0].contains("IRONIC_IMAGE_WORKER__HOST"), "{lines:?}");
        assert!(lines[1].contains("--set nodot"), "{lines:?}");
    }
}
