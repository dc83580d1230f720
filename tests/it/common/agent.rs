//! ironic-python-agent 13's own download-and-verify code
//! (`tests/helpers/ipa_download.py`) run against a served image URL, as a
//! node's ramdisk runs it: the tests of HTTPS, Basic authentication and
//! compressed serving all ask it whether an agent gets verified bytes.

use super::{ironic_python, sha256sum};
use std::path::Path;

/// What the agent's download of `url` (checked against `sha256`) ends
/// with: whether it downloaded and verified the image, and its output.
/// The agent trusts `ca` (it loads its CA file whatever the URL's scheme);
/// `auth` goes into the image_info as Ironic's agent deploy puts
/// `[deploy]image_server_*`. A verified file is checked once more here.
pub async fn ipa_download(
    dir: &Path,
    url: &str,
    sha256: &str,
    ca: &Path,
    auth: Option<(&str, &str)>,
) -> (bool, String) {
    let id = format!("image-{}", uuid::Uuid::new_v4().simple());
    let mut info = serde_json::json!({
        "id": id,
        "urls": [url],
        "os_hash_algo": "sha256",
        "os_hash_value": sha256,
        "stream_raw_images": false,
    });
    if let Some((user, password)) = auth {
        info["image_server_auth_strategy"] = "http_basic".into();
        info["image_server_user"] = user.into();
        info["image_server_password"] = password.into();
    }
    let work = dir.join(format!("ipa-{id}"));
    std::fs::create_dir_all(&work).unwrap();
    let info_path = work.join("image_info.json");
    std::fs::write(&info_path, info.to_string()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/helpers/ipa_download.py");
    let python = tokio::task::spawn_blocking(ironic_python).await.unwrap();
    let out = tokio::process::Command::new(python)
        .arg(script)
        .arg(&info_path)
        .arg(&work)
        .arg(ca)
        .arg("1.3")
        .output()
        .await
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let ok = out.status.success() && text.contains("downloaded and verified");
    if ok {
        assert_eq!(sha256sum(&work.join(&id)), sha256);
    }
    (ok, text)
}
