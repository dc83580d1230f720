//! Which configuration the command line reads, and `config check` /
//! `config show`.
//!
//! Every command reads the files the service reads: the ones named by
//! `--config` / `--ironic-config` (or their environment variables), else
//! the system ones the packaged unit uses when they exist, so `cache list`,
//! `send` or a one-shot `prepare` run by an operator act on the service's
//! cache and broker, not on a state directory where they were started. An
//! empty name (`--ironic-config ''`) reads no file.

use crate::config::{Files, Loaded, Problem};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The worker's own configuration file the packaged unit reads.
pub const SYSTEM_CONFIG: &str = "/etc/ironic-image-worker/worker.toml";

/// The conductor's configuration the packaged unit reads.
pub const SYSTEM_IRONIC_CONF: &str = "/etc/ironic/ironic.conf";

/// The files to read: each as named, none when named empty, else the
/// system one when it exists.
pub fn files(toml: Option<&OsString>, ironic_conf: Option<&OsString>) -> Files {
    let pick = |given: Option<&OsString>, system: &str| match given {
        Some(name) if name.is_empty() => None,
        Some(name) => Some(PathBuf::from(name)),
        None => Path::new(system).exists().then(|| PathBuf::from(system)),
    };
    Files {
        toml: pick(toml, SYSTEM_CONFIG),
        ironic_conf: pick(ironic_conf, SYSTEM_IRONIC_CONF),
    }
}

/// The files read, for logs and `config show`: `worker.toml and
/// ironic.conf`, or that there are none.
pub fn describe(files: &Files) -> String {
    let names: Vec<String> = [&files.toml, &files.ironic_conf]
        .into_iter()
        .flatten()
        .map(|p| p.display().to_string())
        .collect();
    match names.is_empty() {
        true => "none (built-in defaults)".to_string(),
        false => names.join(", "),
    }
}

/// `config check`: one line per problem on stdout and exit 1, or exit 0;
/// warnings on stderr either way. The directories are checked for the
/// user running the check (run it as the service's user).
pub fn check(loaded: Result<Loaded, Vec<Problem>>, files: &Files) -> ExitCode {
    let mut loaded = match loaded {
        Ok(loaded) => loaded,
        Err(problems) => return refused(&problems),
    };
    let problems = loaded.check_dirs();
    for warning in &loaded.warnings {
        eprintln!("warning: {warning}");
    }
    if !problems.is_empty() {
        return refused(&problems);
    }
    println!("configuration is valid (files: {})", describe(files));
    ExitCode::SUCCESS
}

/// `config show`: the configuration in force with each value's source.
pub fn show(loaded: Result<Loaded, Vec<Problem>>, files: &Files) -> ExitCode {
    let loaded = match loaded {
        Ok(loaded) => loaded,
        Err(problems) => return refused(&problems),
    };
    for warning in &loaded.warnings {
        eprintln!("warning: {warning}");
    }
    println!(
        "# ironic-image-worker configuration in force; files read: {}",
        describe(files)
    );
    println!("# each option is followed by where its value came from; secrets are masked\n");
    print!("{}", loaded.show());
    ExitCode::SUCCESS
}

/// Prints every problem, one a line, on stdout; exit code 1.
fn refused(problems: &[Problem]) -> ExitCode {
    for problem in problems {
        println!("{problem}");
    }
    ExitCode::FAILURE
}
