//! The deploy interface (`ironic-plugin/`) installed into the Ironic
//! virtualenv of the tests, for the tests that run Ironic with it
//! (tests/it/ironic_plugin.rs, tests/vm.rs).

use super::{ironic_python, tool};
use std::path::{Path, PathBuf};

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
