//! The documented precedence of the layers, checked for every option the
//! worker shares with Ironic, whichever configuration files exist: one
//! table over the code's own list of shared options
//! (`ironic_conf::shared_names`), so an option added there is checked too.

use super::gather::{self, Files};
use super::ironic_conf::{oslo_env_name, shared_names};
use super::origin::Source;
use super::{Config, read};
use std::path::Path;

/// The layers that can give a shared option a value, lowest first.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Layer {
    IronicConf,
    OsloEnv,
    Toml,
    WorkerEnv,
    Flag,
}

const LAYERS: [Layer; 5] = [
    Layer::IronicConf,
    Layer::OsloEnv,
    Layer::Toml,
    Layer::WorkerEnv,
    Layer::Flag,
];

/// The worker's file as the package and the image ship it: every option
/// commented out.
const SHIPPED_TOML: &str = include_str!("../../ops/worker.example.toml");

/// A value the layer gives: text that says which layer gave it (an AMQP
/// URL for `transport_url`, which must read as one).
fn value(layer: Layer, ironic: (&str, &str)) -> String {
    let marker = format!("{layer:?}").to_ascii_lowercase();
    match ironic {
        ("DEFAULT", "transport_url") => format!("rabbit://u:p@{marker}:5672/"),
        _ => marker,
    }
}

/// The shipped file with `[section] option = value` set under its section
/// (the file names every section, options commented out).
fn with_line((section, option): (&str, &str), value: &str) -> String {
    let header = format!("\n[{section}]\n");
    let line = format!("{option} = {value:?}\n");
    match SHIPPED_TOML.find(&header) {
        Some(at) => {
            let (before, after) = SHIPPED_TOML.split_at(at + header.len());
            format!("{before}{line}{after}")
        }
        None => format!("{SHIPPED_TOML}{header}{line}"),
    }
}

/// One case: the files present, the layers that set the option. Returns
/// what was found wrong, if anything.
fn case(
    dir: &Path,
    ironic: (&str, &str),
    worker: (&str, &str),
    conf: bool,
    toml: bool,
    set: &[Layer],
) -> Option<String> {
    let has = |l: Layer| set.contains(&l);
    let conf_path = dir.join("ironic.conf");
    let toml_path = dir.join("worker.toml");
    let mut conf_text = String::from("[DEFAULT]\n");
    if has(Layer::IronicConf) {
        let v = value(Layer::IronicConf, ironic);
        conf_text.push_str(&format!("[{}]\n{} = {v}\n", ironic.0, ironic.1));
    }
    std::fs::write(&conf_path, conf_text).unwrap();
    let toml_text = match has(Layer::Toml) {
        true => with_line(worker, &value(Layer::Toml, ironic)),
        false => SHIPPED_TOML.to_string(),
    };
    std::fs::write(&toml_path, toml_text).unwrap();
    let mut env = Vec::new();
    if has(Layer::OsloEnv) {
        env.push((
            oslo_env_name(ironic.0, ironic.1),
            value(Layer::OsloEnv, ironic),
        ));
    }
    if has(Layer::WorkerEnv) {
        let name = format!(
            "{}{}__{}",
            super::ENV_PREFIX,
            worker.0.to_ascii_uppercase(),
            worker.1.to_ascii_uppercase()
        );
        env.push((name, value(Layer::WorkerEnv, ironic)));
    }
    let mut flags = Vec::new();
    if has(Layer::Flag) {
        let v = value(Layer::Flag, ironic);
        flags.push(format!("{}.{}={v}", worker.0, worker.1));
    }
    let files = Files {
        ironic_conf: conf.then_some(conf_path),
        toml: toml.then_some(toml_path),
    };
    let layers = match gather::layers(&files, &env, &flags) {
        Ok(l) => l,
        Err(problems) => return Some(format!("unreadable: {problems:?}")),
    };
    let stack = layers.stack(worker.0, worker.1);
    let effective = stack.last();
    match set.last() {
        None => effective
            .filter(|s| !matches!(s.source, Source::Default | Source::FileDefault(_)))
            .map(|s| format!("set by nothing, yet {} from {}", s.value.text(), s.source)),
        Some(&winner) => {
            let want = value(winner, ironic);
            let marker = format!("{winner:?}").to_ascii_lowercase();
            match effective {
                Some(s) if s.value.text().contains(&marker) => None,
                Some(s) => Some(format!(
                    "want {want} ({winner:?}), got {} from {}",
                    s.value.text(),
                    s.source
                )),
                None => Some(format!("want {want} ({winner:?}), got nothing")),
            }
        }
    }
}

/// Every shared option, every combination of present files (ironic.conf,
/// the shipped worker.toml), every combination of the layers that set it:
/// the highest layer that sets it wins, and with none the value is a
/// default.
#[test]
fn every_shared_option_takes_the_highest_layer_whichever_files_exist() {
    let dir = tempfile::tempdir().unwrap();
    let mut wrong = Vec::new();
    let mut cases = 0;
    for (ironic, worker) in shared_names() {
        for (conf, toml) in [(false, false), (true, false), (false, true), (true, true)] {
            for mask in 0u32..(1 << LAYERS.len()) {
                let set: Vec<Layer> = LAYERS
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| mask & (1 << i) != 0)
                    .map(|(_, l)| *l)
                    .collect();
                if (!conf && set.contains(&Layer::IronicConf))
                    || (!toml && set.contains(&Layer::Toml))
                {
                    continue;
                }
                cases += 1;
                if let Some(why) = case(dir.path(), ironic, worker, conf, toml, &set) {
                    wrong.push(format!(
                        "[{}]{} (ironic.conf {conf}, worker.toml {toml}, set by {set:?}): {why}",
                        worker.0, worker.1
                    ));
                }
            }
        }
    }
    assert!(cases > 2000, "{cases} cases: the option list is empty?");
    assert!(
        wrong.is_empty(),
        "{} of {cases} cases wrong, e.g.:\n{}",
        wrong.len(),
        wrong
            .iter()
            .take(12)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Metal3's shape, typed: the shipped worker.toml, no ironic.conf, Ironic's
/// own variables for what the worker shares with it.
#[test]
fn ironics_variables_configure_the_worker_beside_the_shipped_file() {
    let dir = tempfile::tempdir().unwrap();
    let toml = dir.path().join("worker.toml");
    std::fs::write(&toml, SHIPPED_TOML).unwrap();
    let env: Vec<(String, String)> = [
        ("OS_DEPLOY__HTTP_ROOT", "/shared/html"),
        ("OS_DEPLOY__HTTP_URL", "http://192.0.2.1:6180"),
        ("OS_PXE__IMAGES_PATH", "/shared/image-worker/images"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let files = Files {
        ironic_conf: None,
        toml: Some(toml),
    };
    let config: Config = read(&files, &env, &[]).unwrap().config;
    assert_eq!(config.deploy.http_root, Path::new("/shared/html"));
    assert_eq!(config.deploy.http_url, "http://192.0.2.1:6180");
    assert_eq!(
        config.pxe.images_path,
        Path::new("/shared/image-worker/images")
    );
}
