//! Contracts other programs rely on: configuration precedence and the
//! closed list of error codes in the completion schema.

use ironic_image_worker::config::Config;
use ironic_image_worker::error::ErrorCode;

#[test]
fn schema_lists_exactly_the_error_codes() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/schemas/completion.v1.json"
    ))
    .unwrap();
    let schema: serde_json::Value = serde_json::from_str(&text).unwrap();
    let listed: Vec<String> = schema["properties"]["error"]["properties"]["code"]["enum"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    let ours: Vec<String> = ErrorCode::ALL
        .iter()
        .map(|c| c.as_str().to_string())
        .collect();
    assert_eq!(listed, ours);
    for code in ErrorCode::ALL {
        assert_eq!(serde_json::to_value(code).unwrap(), code.as_str());
    }
}

#[test]
fn file_then_environment_then_flags() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("w.toml");
    std::fs::write(
        &file,
        "[DEFAULT]\nhost = \"from-file\"\nforce_raw_images = false\n[pxe]\nimage_cache_size = 100\n[conductor]\npermitted_image_formats = \"raw, qcow2\"\n",
    )
    .unwrap();
    let env = vec![
        (
            "IRONIC_IMAGE_WORKER__DEFAULT__HOST".to_string(),
            "from-env".to_string(),
        ),
        (
            "IRONIC_IMAGE_WORKER__PXE__IMAGE_CACHE_SIZE".to_string(),
            "200".to_string(),
        ),
        (
            "IRONIC_IMAGE_WORKER__HTTP__LISTEN".to_string(),
            "127.0.0.1:9999".to_string(),
        ),
    ];
    let c = Config::load_from(Some(&file), &env, &["DEFAULT.host=from-flag".into()]).unwrap();
    assert_eq!(c.default.host, "from-flag");
    assert!(!c.default.force_raw_images);
    assert_eq!(c.pxe.image_cache_size, 200);
    assert_eq!(c.http.listen.port(), 9999);
    assert_eq!(c.conductor.permitted_image_formats, ["raw", "qcow2"]);
    assert_eq!(c.http_url(), "http://127.0.0.1:9999");

    assert!(Config::load_from(None, &[], &["agent.image_download_source=ftp".into()]).is_err());
    assert!(Config::load_from(None, &[], &["nosuch.option=1".into()]).is_err());
}

#[test]
fn defaults_need_no_root() {
    let c = Config::load_from(None, &[], &[]).unwrap();
    assert!(
        c.pxe.instance_master_path.is_relative()
            || !c.pxe.instance_master_path.starts_with("/var/lib")
    );
    assert_eq!(c.amqp.url, "amqp://guest:guest@127.0.0.1:5672/%2f");
    assert_eq!(c.deploy.http_image_subdir, "agent_images");
    assert_eq!(
        c.conductor.permitted_image_formats,
        ["raw", "gpt", "qcow2", "iso"]
    );
    assert!(c.default.force_raw_images && c.agent.stream_raw_images);
    assert_eq!(c.amqp_url_redacted(), "amqp://guest:***@127.0.0.1:5672/%2f");
}
