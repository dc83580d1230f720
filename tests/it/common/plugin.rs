//! The deploy interface (`ironic-plugin/`) installed into the Ironic
//! virtualenv of the tests, for the tests that run Ironic with it
//! (tests/it/ironic_plugin.rs, tests/vm.rs).

use super::{AMQP_URL, BIN, Env, ironic_python, tool};
use rustix::process::{Pid, Signal, kill_process_group, test_kill_process_group};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The plugin's source directory in this checkout.
pub fn plugin_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("ironic-plugin")
}

/// Ironic's Python with this checkout's plugin installed (editable, so the
/// tests run the code of this checkout); reinstalled only when the venv's
/// copy points elsewhere, under the venv's lock.
pub fn plugin_python() -> PathBuf {
    let python = ironic_python();
    let venv = python.parent().unwrap().parent().unwrap().to_path_buf();
    let lock = std::fs::File::create(venv.parent().unwrap().join("ironic-venv.lock")).unwrap();
    lock.lock().unwrap();
    let package = plugin_dir().join("ironic_image_worker_deploy");
    let installed = std::process::Command::new(&python)
        .args([
            "-c",
            "import importlib.metadata as m, os, ironic_image_worker_deploy as p\n\
             assert any(e.name == 'direct-worker' for e in \
             m.entry_points(group='ironic.hardware.interfaces.deploy'))\n\
             assert any(e.name == 'redfish-worker' for e in \
             m.entry_points(group='ironic.hardware.types'))\n\
             print(os.path.dirname(p.__file__))",
        ])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    if installed.as_deref() != Some(package.to_str().unwrap()) {
        tool(
            venv.join("bin/pip").to_str().unwrap(),
            &[
                "install",
                "-q",
                "--disable-pip-version-check",
                "--no-deps",
                "-e",
                plugin_dir().to_str().unwrap(),
            ],
        );
    }
    python
}

/// How long one pytest run of the plug-in's integration cases may take
/// (they start Ironic, workers and a Glance of their own; a loaded 2-vCPU
/// machine has needed more than 300 s).
pub const PYTEST_TIMEOUT: Duration = Duration::from_secs(900);

/// A pytest run's process group, interrupted and then killed when dropped
/// before it ended: what the cases started (an Ironic conductor, a worker)
/// goes with it, even when the test fails or times out.
struct Group(Option<Pid>);

impl Drop for Group {
    fn drop(&mut self) {
        if let Some(pid) = self.0.take() {
            // SIGINT first: pytest runs the cases' clean-ups on it.
            if kill_process_group(pid, Signal::INT).is_err() {
                return; // nothing left in the group
            }
            for _ in 0..100 {
                if test_kill_process_group(pid).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = kill_process_group(pid, Signal::KILL);
        }
    }
}

/// Runs `python -m pytest -q <args>` in the plug-in's folder, in a
/// process group of its own (see [`Group`]), with the variables that name
/// `worker` (its binary, host, HTTP port and directories) and the broker
/// (`IIW_TRANSPORT_URL`, as ironic.conf's `transport_url`), then `env`;
/// returns whether it passed and its output. Panics after
/// [`PYTEST_TIMEOUT`].
pub async fn pytest(
    python: &Path,
    args: &[&str],
    worker: &Env,
    env: &[(&str, String)],
) -> (bool, String) {
    let dir = |p: &Path| p.display().to_string();
    let transport_url = AMQP_URL
        .replacen("amqp://", "rabbit://", 1)
        .replace("%2f", "");
    let named = [
        ("IIW_WORKER_BIN", BIN.to_string()),
        ("IIW_WORKER_HOST", worker.host.clone()),
        ("IIW_WORKER_HTTP_PORT", worker.http_port.to_string()),
        (
            "IIW_WORKER_HTTP_ROOT",
            dir(worker.link_dir().parent().unwrap()),
        ),
        ("IIW_WORKER_IMAGES_PATH", dir(&worker.images_dir())),
        ("IIW_TRANSPORT_URL", transport_url),
    ];
    let mut cmd = tokio::process::Command::new(python);
    cmd.args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .args(["-W", "ignore::DeprecationWarning"])
        .args(args)
        .current_dir(plugin_dir())
        .env_remove("IRONIC_IMAGE_WORKER_CONFIG")
        .envs(named.iter().chain(env).map(|(k, v)| (*k, v.as_str())))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .process_group(0);
    let child = cmd.spawn().expect("pytest starts");
    let group = Group(child.id().and_then(|id| Pid::from_raw(id as i32)));
    let out = tokio::time::timeout(PYTEST_TIMEOUT, child.wait_with_output()).await;
    let Ok(out) = out else {
        drop(group);
        panic!("pytest did not finish in {PYTEST_TIMEOUT:?}: interrupted, then killed");
    };
    let out = out.expect("pytest's output");
    // Ended: whatever it left running in its group goes now.
    drop(group);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}
