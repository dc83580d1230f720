//! `config show`: the configuration in force, option by option, each with
//! where its value came from and secrets masked. The output is TOML (an
//! unset option is a comment), so it can be compared with a file or kept.

use super::{Config, Layers};
use crate::secrets::{is_secret_option, shown_value};
use std::fmt::Write;

/// The effective configuration of `config` as TOML, every option followed
/// by its source (`# default`, `# /etc/ironic/ironic.conf [DEFAULT]host`...).
pub fn show(config: &Config, layers: &Layers) -> String {
    let mut out = String::new();
    let Ok(serde_json::Value::Object(sections)) = serde_json::to_value(config) else {
        return out;
    };
    for (section, options) in sections {
        let serde_json::Value::Object(options) = options else {
            continue;
        };
        let _ = writeln!(out, "[{section}]");
        for (option, value) in options {
            let source = layers.source_of(&section, &option);
            let line = match shown(&option, &value) {
                Some(text) => format!("{option} = {text}"),
                None => format!("# {option} is unset"),
            };
            let _ = writeln!(out, "{line}  # {source}");
        }
        out.push('\n');
    }
    out
}

/// An option's value as TOML, masked: `None` when it is unset.
fn shown(option: &str, value: &serde_json::Value) -> Option<String> {
    use serde_json::Value;
    let string = |s: &str| toml::Value::String(shown_value(option, s)).to_string();
    Some(match value {
        Value::Null => return None,
        Value::String(s) if is_secret_option(option) && !s.is_empty() => string("***"),
        Value::String(s) => string(s),
        Value::Array(items) => {
            let items: Vec<String> = items.iter().filter_map(|v| shown(option, v)).collect();
            format!("[{}]", items.join(", "))
        }
        other => other.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::super::{Files, read};

    #[test]
    fn every_option_with_its_source_and_no_secret() {
        let env = [
            (
                "IRONIC_IMAGE_WORKER__GLANCE__PASSWORD".to_string(),
                "s3cr3t".to_string(),
            ),
            ("OS_DEFAULT__HOST".to_string(), "cond-9".to_string()),
        ];
        let flags = ["amqp.url=amqp://u:pw@mq:5672/%2f".to_string()];
        let loaded = read(&Files::default(), &env, &flags).unwrap();
        let text = super::show(&loaded.config, &loaded.layers);
        assert!(!text.contains("s3cr3t") && !text.contains(":pw@"), "{text}");
        assert!(
            text.contains(
                "password = \"***\"  # environment IRONIC_IMAGE_WORKER__GLANCE__PASSWORD"
            ),
            "{text}"
        );
        assert!(
            text.contains("host = \"cond-9\"  # environment OS_DEFAULT__HOST"),
            "{text}"
        );
        assert!(
            text.contains("url = [\"amqp://u:***@mq:5672/%2f\"]  # --set amqp.url"),
            "{text}"
        );
        assert!(text.contains("prefetch = 32  # default"), "{text}");
        assert!(
            text.contains("# webserver_verify_ca is unset  # default"),
            "{text}"
        );
        assert!(text.contains("[log]\n"), "{text}");
        // What it prints is TOML again.
        let uncommented: String = text
            .lines()
            .map(|l| l.split("  #").next().unwrap_or(l))
            .collect::<Vec<_>>()
            .join("\n");
        uncommented.parse::<toml::Table>().unwrap();
    }
}
