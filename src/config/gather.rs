//! Reads every layer of the configuration, lowest precedence first (see
//! `layers.rs`): an ironic.conf and oslo.config's variables, the worker's
//! TOML file, `IRONIC_IMAGE_WORKER__*` variables, `--set` flags.

use super::check::Problem;
use super::ironic_conf;
use super::layers::{Layers, Raw};
use super::origin::Source;
use std::path::{Path, PathBuf};

/// Prefix of the environment variables that override configuration options.
pub const ENV_PREFIX: &str = "IRONIC_IMAGE_WORKER__";

/// The configuration files to read, lowest precedence first.
#[derive(Debug, Clone, Default)]
pub struct Files {
    /// An existing ironic.conf: the options shared with the conductor.
    pub ironic_conf: Option<PathBuf>,
    /// The worker's own TOML file.
    pub toml: Option<PathBuf>,
}

/// Reads every layer: `files`, the `env` variables of both prefixes,
/// then `flags` (`section.option=value`). A layer that cannot be read
/// (a missing or malformed file, a malformed name) is a problem.
pub fn layers(
    files: &Files,
    env: &[(String, String)],
    flags: &[String],
) -> Result<Layers, Vec<Problem>> {
    let mut layers =
        ironic_conf::load(files.ironic_conf.as_deref(), env).map_err(|problem| vec![problem])?;
    let mut problems = Vec::new();
    if let Some(path) = &files.toml {
        if files.ironic_conf.is_none() {
            add_system_dirs(&mut layers, path);
        }
        if let Err(problem) = add_toml(&mut layers, path) {
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
fn add_system_dirs(layers: &mut Layers, file: &Path) {
    let source = Source::FileDefault(file.to_path_buf());
    for (section, key, dir) in [
        ("pxe", "instance_master_path", super::SYSTEM_MASTER_PATH),
        ("pxe", "images_path", super::pxe::SYSTEM_IMAGES_PATH),
        ("deploy", "http_root", super::deploy::SYSTEM_HTTP_ROOT),
    ] {
        layers.set(section, key, Raw::Text(dir.to_string()), source.clone());
    }
}

/// Adds the worker's TOML file: every `[section] option = value`.
fn add_toml(layers: &mut Layers, path: &Path) -> Result<(), Problem> {
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
                    layers.set(&section, &key, Raw::Toml(value), source.clone());
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
        let layers = layers(
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
        let layers = layers(
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
        let problems = layers(
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
