//! Where an option's value came from, and which layer wins: the one
//! order of the configuration's layers, named by every problem, every
//! `config show` line and every layer that records a value.

use std::fmt;
use std::path::PathBuf;

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
    pub(super) fn rank(&self) -> u8 {
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
