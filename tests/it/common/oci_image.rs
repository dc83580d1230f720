//! The project's container image, built by the recipe operators run
//! (`packaging/oci/build`) with the binary under test, once per run of the
//! tests for all that need it: tests/it/packaging.rs pushes and pulls it,
//! tests/it/metal3_pod.rs runs it in a pod (mmdebstrap takes about a
//! minute and a half; building it twice would double that).

use super::BIN;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

/// The tag the image has in its layout.
pub const TAG: &str = "test";

/// The OCI image layout holding the image as [`TAG`]. The first caller
/// builds it (into the same directory under Cargo's temporary directory
/// every run, replaced, so that runs leave one copy at most), the others
/// wait for it; a failed build fails each caller. Blocking: call it from
/// `spawn_blocking` in an async test.
pub fn worker_image_layout() -> PathBuf {
    static BUILT: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(layout) = built.as_ref() {
        return layout.clone();
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("oci-image");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let layout = dir.join("layout");
    let out = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/packaging/oci/build"))
        .args(["--binary", BIN, "--tag", TAG, "--layout"])
        .arg(&layout)
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && printed.trim().ends_with(&format!(":{TAG}")),
        "packaging/oci/build: {printed}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    *built = Some(layout.clone());
    layout
}
