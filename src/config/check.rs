//! What is wrong with a configuration, option by option: each problem
//! names the option and where its value came from, so `config check`, a
//! refused start and a warning all point at the line to change.

use super::choice::AuthStrategy;
use super::origin::Source;
use crate::error::{Error, ErrorCode};
use std::fmt;

/// One thing wrong (or worth a warning) in the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The option, `(section, option)`, when one is to blame (a file that
    /// cannot be read names none).
    pub option: Option<(String, String)>,
    /// Where the value came from.
    pub source: Source,
    /// What is wrong, for the operator.
    pub message: String,
}

impl Problem {
    /// A problem of a whole source (a file, a variable, a flag).
    pub fn of_source(source: Source, message: String) -> Problem {
        Problem {
            option: None,
            source,
            message,
        }
    }

    /// A problem of option `[section] option`, its source looked up later
    /// ([`super::Layers::blame`]).
    pub fn of_option(section: &str, option: &str, message: String) -> Problem {
        Problem {
            option: Some((section.to_string(), option.to_string())),
            source: Source::Default,
            message,
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.option {
            Some((section, option)) => {
                write!(f, "[{section}]{option} ({}): {}", self.source, self.message)
            }
            None => write!(f, "{}: {}", self.source, self.message),
        }
    }
}

/// The problems found by the checks: errors refuse the configuration,
/// warnings are logged at start and shown by `config check`.
#[derive(Debug, Default)]
pub struct Report {
    /// What refuses the configuration.
    pub errors: Vec<Problem>,
    /// What is allowed but likely wrong.
    pub warnings: Vec<Problem>,
}

impl Report {
    /// Records that `[section] option` is wrong.
    pub fn error(&mut self, section: &str, option: &str, message: impl Into<String>) {
        self.errors
            .push(Problem::of_option(section, option, message.into()));
    }

    /// Records that `[section] option` is allowed but likely wrong.
    pub fn warn(&mut self, section: &str, option: &str, message: impl Into<String>) {
        self.warnings
            .push(Problem::of_option(section, option, message.into()));
    }

    /// Checks one HTTP Basic set-up of `section`: `http_basic` needs a user
    /// (without `:`) and a password; `names` are the options of the
    /// strategy, the user and the password, `credentials` the user's and
    /// the password's values.
    pub fn basic_auth(
        &mut self,
        section: &str,
        names: [&str; 3],
        strategy: AuthStrategy,
        credentials: [&str; 2],
    ) {
        let [strategy_name, user_name, password_name] = names;
        let [user, password] = credentials;
        if strategy == AuthStrategy::NoAuth {
            return;
        }
        if user.is_empty() || password.is_empty() {
            self.error(
                section,
                strategy_name,
                format!("http_basic needs {user_name} and {password_name}"),
            );
        } else if user.contains(':') {
            self.error(section, user_name, "must not contain ':' (HTTP Basic)");
        }
    }

    /// Checks one HTTPS set-up of `section` (`tls_cert_file`,
    /// `tls_key_file`): both files or neither, each readable.
    pub fn tls(&mut self, section: &str, cert: &str, key: &str) {
        if cert.is_empty() != key.is_empty() {
            let set = if cert.is_empty() {
                "tls_key_file"
            } else {
                "tls_cert_file"
            };
            self.error(section, set, "tls_cert_file and tls_key_file go together");
        }
        for (name, path) in [("tls_cert_file", cert), ("tls_key_file", key)] {
            if !path.is_empty()
                && let Err(e) = std::fs::metadata(path)
            {
                self.error(section, name, format!("{path}: {e}"));
            }
        }
    }

    /// Records that `[section] option` is too large to be converted to
    /// the unit of `unit` (a wrapped limit would be a tiny one).
    pub fn fits(&mut self, section: &str, option: &str, value: u64, unit: u64) {
        if value.checked_mul(unit).is_none() {
            self.error(
                section,
                option,
                format!("{value} is too large (at most {})", u64::MAX / unit),
            );
        }
    }
}

/// The error a refused configuration stops the worker with: every problem,
/// one a line.
pub fn refusal(problems: &[Problem]) -> Error {
    let lines: Vec<String> = problems.iter().map(ToString::to_string).collect();
    Error::new(
        ErrorCode::Internal,
        format!("configuration: {}", lines.join("\n")),
    )
}

/// A configuration error of one option, outside the checks (a file an
/// option names that no longer loads when it is used).
pub fn config_error(message: String) -> Error {
    Error::new(ErrorCode::Internal, format!("configuration: {message}"))
}
