//! The Metal3 sidecar example (`ops/kubernetes/metal3-sidecar.yaml`) as its
//! worker container reads it: the options shared with Ironic come from
//! Ironic's own `OS_<GROUP>__<OPTION>` variables, set to the same values
//! in the Ironic container, and win over the worker.toml the image ships.

use crate::common::BIN;
use std::collections::BTreeMap;
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Every container's literal `env` (`name` and `value`; `valueFrom` ones
/// are left out), by container name, read from the manifest's lines.
fn containers_env(manifest: &str) -> BTreeMap<String, Vec<(String, String)>> {
    let mut out: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    let mut in_containers = false;
    let mut container: Option<String> = None;
    let mut name: Option<String> = None;
    for line in manifest.lines() {
        if line.trim_end() == "  containers:" {
            in_containers = true;
        } else if let Some(c) = line.strip_prefix("    - name: ").filter(|_| in_containers) {
            container = Some(c.trim().to_string());
        } else if let Some(n) = line.strip_prefix("        - name: ") {
            name = Some(n.trim().to_string());
        } else if let Some(v) = line.strip_prefix("          value: ")
            && let (Some(c), Some(n)) = (&container, name.take())
        {
            let v = v.trim().trim_matches('"').to_string();
            out.entry(c.clone()).or_default().push((n, v));
        }
    }
    out
}

/// The worker container's variables, run through `config show` beside the
/// shipped worker.toml: `[deploy]http_root` and `http_url` come from the
/// `OS_` variables the Ironic container has too (same values), and the
/// worker sets no `IRONIC_IMAGE_WORKER__` variable for them.
#[test]
fn the_sidecar_takes_what_it_shares_with_ironic_from_ironics_variables() {
    let manifest =
        std::fs::read_to_string(format!("{ROOT}/ops/kubernetes/metal3-sidecar.yaml")).unwrap();
    let env = containers_env(&manifest);
    let worker = &env["image-worker"];
    let ironic = &env["ironic"];
    let oslo: Vec<&(String, String)> = worker
        .iter()
        .filter(|(n, _)| n.starts_with("OS_"))
        .collect();
    assert!(
        oslo.iter().any(|(n, _)| n == "OS_DEPLOY__HTTP_ROOT")
            && oslo.iter().any(|(n, _)| n == "OS_DEPLOY__HTTP_URL"),
        "{worker:?}"
    );
    for pair in &oslo {
        assert!(
            ironic.contains(pair),
            "{pair:?} is not Ironic's: {ironic:?}"
        );
    }
    for shared in ["DEPLOY__HTTP_ROOT", "DEPLOY__HTTP_URL"] {
        assert!(
            !worker
                .iter()
                .any(|(n, _)| n == &format!("IRONIC_IMAGE_WORKER__{shared}")),
            "the worker sets {shared} apart from Ironic"
        );
    }
    // The Secrets' files (htpasswd, TLS) exist only in a pod.
    let here: Vec<&(String, String)> = worker
        .iter()
        .filter(|(n, _)| !n.starts_with("IRONIC_IMAGE_WORKER__JSON_RPC__"))
        .collect();
    let out = Command::new(BIN)
        .args(["--config", &format!("{ROOT}/ops/worker.example.toml")])
        .args(["--ironic-config", "", "config", "show"])
        .args(["--set", "json_rpc.listen=127.0.0.1:8099"])
        .env_clear()
        .envs(here.iter().map(|(n, v)| (n, v)))
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{shown}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let value_of = |option: &str| {
        shown
            .lines()
            .find(|l| l.starts_with(&format!("{option} = ")))
            .unwrap_or_else(|| panic!("no {option} in:\n{shown}"))
            .to_string()
    };
    let root = value_of("http_root");
    assert!(
        root.contains("\"/shared/html\"") && root.contains("environment OS_DEPLOY__HTTP_ROOT"),
        "{root}"
    );
    let url = value_of("http_url");
    assert!(
        url.contains("\"http://PROVISIONING-IP:6180\"")
            && url.contains("environment OS_DEPLOY__HTTP_URL"),
        "{url}"
    );
}
