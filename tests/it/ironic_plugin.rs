//! The `direct-worker` Ironic deploy interface (`ironic-plugin/`) against
//! real parts: Ironic 39 from PyPI with its own test database and
//! TaskManager, the real RabbitMQ, this worker binary, images made with
//! qemu-img, a registry (Debian's `docker-registry`, started by the OCI
//! case), and ironic-python-agent's download code verifying the result.
//! The cases live in `ironic-plugin/ironic_image_worker_deploy/tests/`
//! (pytest); this test installs the plugin into the Ironic virtualenv,
//! starts the worker and passes its parameters in `IIW_*` variables.

use crate::common;

use common::plugin::{plugin_dir, plugin_python};
use common::*;
use std::path::PathBuf;

/// The plug-in's own unit tests (Ironic's code and test fixtures, no
/// worker, broker or network), run as its developers run them in its
/// folder; `.ci/run` runs this test first, which also makes the Ironic
/// virtualenv with the plug-in installed.
#[test]
fn plugin_unit_tests() {
    let out = std::process::Command::new(plugin_python())
        .args([
            "-m",
            "pytest",
            "-q",
            "ironic_image_worker_deploy/tests/unit",
        ])
        .current_dir(plugin_dir())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "pytest failed:\n{text}");
    assert!(
        !text.contains(" skipped"),
        "no case may be skipped:\n{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_worker_deploy_interface_in_ironic() {
    let python = tokio::task::spawn_blocking(plugin_python).await.unwrap();
    // The test's Glance (Python, inside the pytest run) listens here.
    let glance_port = free_port();
    let env = Env::new(&format!(
        "[glance]\nauth_type = \"admin_token\"\ntoken = \"test-token\"\n\
         endpoint_override = \"http://127.0.0.1:{glance_port}/image\"\n\
         [oci]\npermit_fallback_to_http_transport = true\n"
    ));
    // A worker the tests start and stop (its queue outlives it).
    let spare = Env::new("");
    let worker = env.serve().await;
    // A worker with no broker at all, called through Ironic's JSON-RPC
    // client over TLS (a CA of the test's own) with HTTP Basic.
    let rpc = RpcWorker::start().await;

    let dir = |p: &std::path::Path| p.display().to_string();
    let (passed, text) = common::plugin::pytest(
        &python,
        &[
            "--ignore=ironic_image_worker_deploy/tests/unit",
            // Run by tests/it/sealed.rs against a worker of its own.
            "--ignore=ironic_image_worker_deploy/tests/test_sealed.py",
            "ironic_image_worker_deploy/tests",
        ],
        &env,
        &[
            ("IIW_GLANCE_PORT", glance_port.to_string()),
            ("IIW_SPARE_CONFIG", dir(&spare.config)),
            ("IIW_SPARE_HOST", spare.host.clone()),
            ("IIW_SPARE_METRICS_PORT", spare.metrics_port.to_string()),
            ("IIW_RPC_PORT", rpc.port.to_string()),
            ("IIW_RPC_CA", dir(&rpc.ca)),
            ("IIW_RPC_USER", "ironic".to_string()),
            ("IIW_RPC_PASSWORD", RpcWorker::PASSWORD.to_string()),
            ("IIW_RPC_HTTP_PORT", rpc.env.http_port.to_string()),
            (
                "IIW_RPC_HTTP_ROOT",
                dir(rpc.env.link_dir().parent().unwrap()),
            ),
            ("IIW_RPC_IMAGES_PATH", dir(&rpc.env.images_dir())),
        ],
    )
    .await;
    println!("{text}");
    assert!(passed, "pytest failed (its output is above)");
    assert!(
        !text.contains(" skipped"),
        "no case may be skipped:\n{text}"
    );
    drop(worker);
    drop(rpc);
}

/// A worker with `[amqp]enabled = false` and its JSON-RPC listener over
/// TLS (certificate of a CA of its own) with `http_basic` (user `ironic`);
/// it publishes no MD5 (`[agent]served_md5 = false`).
struct RpcWorker {
    // Stopped before its directories go.
    _worker: Worker,
    env: Env,
    port: u16,
    ca: PathBuf,
    _dir: tempfile::TempDir,
}

impl RpcWorker {
    const PASSWORD: &str = "rpc-s3cret";

    async fn start() -> RpcWorker {
        let dir = tempfile::tempdir().unwrap();
        let ca = ca::TestCa::new(dir.path(), "plugin-rpc-ca");
        let (cert, key) = ca.issue(
            "plugin-rpc",
            "localhost",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        );
        let htpasswd = dir.path().join("htpasswd");
        let file = htpasswd.to_str().unwrap();
        tool("htpasswd", &["-Bbc", file, "ironic", Self::PASSWORD]);
        let port = free_port();
        let env = Env::new(&format!(
            "[amqp]\nenabled = false\n[agent]\nserved_md5 = false\n\
             [json_rpc]\nlisten = \"127.0.0.1:{port}\"\n\
             auth_strategy = \"http_basic\"\nhttp_basic_auth_user_file = \"{file}\"\n\
             tls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n",
            cert.display(),
            key.display()
        ));
        let worker = env.serve().await;
        RpcWorker {
            ca: ca.pem.clone(),
            env,
            port,
            _dir: dir,
            _worker: worker,
        }
    }
}
