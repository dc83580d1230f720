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

use super::check::{Problem, Report};
use super::origin::Source;
use std::collections::BTreeMap;
use std::path::PathBuf;

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
    pub interface_seal: Option<InterfaceSeal>,
    /// Notes of the layers themselves (an ironic.conf option the worker
    /// reads differently).
    pub warnings: Vec<Problem>,
}

/// What an ironic.conf says of the deploy interface's seal: so that
/// `config check` names a deployment where one side seals and the other
/// does not (every command or every answer would then be refused).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InterfaceSeal {
    /// `[image_worker]seal_secret_file`, when set.
    pub secret_file: Option<String>,
    /// `[image_worker]seal`, when set.
    pub mode: Option<String>,
    /// Whether the interface talks to the worker over the broker at all
    /// (`[image_worker]transport` is not `json-rpc`).
    pub over_broker: bool,
    /// Where `seal_secret_file` was read (or would be).
    pub source: Source,
}

impl InterfaceSeal {
    /// The seal mode the interface runs with: `seal`, else `require` with
    /// a key file and `off` without (as the interface's own default).
    pub fn mode(&self) -> &str {
        match (&self.mode, &self.secret_file) {
            (Some(mode), _) => mode.as_str(),
            (None, Some(_)) => "require",
            (None, None) => "off",
        }
    }
}

impl Layers {
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

    /// Fills in where each option a report blames got its value.
    pub fn blame(&self, mut report: Report) -> Report {
        for problem in report.errors.iter_mut().chain(report.warnings.iter_mut()) {
            if let Some((section, option)) = &problem.option {
                problem.source = self.source_of(section, option);
            }
        }
        report
    }
}
