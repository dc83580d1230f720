//! Contracts other programs rely on: configuration precedence and the
//! closed list of error codes in the completion schema.

use ironic_image_worker::config::{Config, Files};
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
    let c = Config::load_from(&toml_file(&file), &env, &["DEFAULT.host=from-flag".into()]).unwrap();
    assert_eq!(c.default.host, "from-flag");
    assert!(!c.default.force_raw_images);
    assert_eq!(c.pxe.image_cache_size, 200);
    assert_eq!(c.http.listen.port(), 9999);
    assert_eq!(c.conductor.permitted_image_formats, ["raw", "qcow2"]);
    assert_eq!(c.http_url(), "http://127.0.0.1:9999");

    assert!(
        Config::load_from(
            &Files::default(),
            &[],
            &["agent.image_download_source=ftp".into()]
        )
        .is_err()
    );
    assert!(Config::load_from(&Files::default(), &[], &["nosuch.option=1".into()]).is_err());
}

#[test]
fn defaults_need_no_root() {
    let c = Config::load_from(&Files::default(), &[], &[]).unwrap();
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

fn toml_file(path: &std::path::Path) -> Files {
    Files {
        toml: Some(path.to_path_buf()),
        ..Files::default()
    }
}

#[test]
fn ironic_conf_gives_the_shared_options_and_our_file_overrides_it() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let dir = tempfile::tempdir().unwrap();
    let own = dir.path().join("w.toml");
    std::fs::write(
        &own,
        "[http]\nlisten = \"192.0.2.10:8088\"\n[pxe]\nimage_cache_ttl = 60\n",
    )
    .unwrap();
    let files = Files {
        ironic_conf: Some(fixtures.join("ironic.conf")),
        toml: Some(own),
    };
    let c = Config::load_from(&files, &[], &["DEFAULT.force_raw_images=false".into()]).unwrap();
    assert_eq!(c.default.host, "cond-7.example.net");
    assert!(!c.default.force_raw_images, "--set beats ironic.conf");
    assert_eq!(
        c.amqp.url,
        "amqp://ironic:Sup3r%2Fsecret@mq-1.example.net:5672/ironic"
    );
    assert_eq!(c.amqp.notification_exchange, "ironic");
    assert_eq!(
        c.amqp.notification_topics,
        ["ironic_versioned_notifications", "ops_notifications"]
    );
    assert!(c.amqp.notification_exchange_durable);
    assert_eq!(c.agent.image_download_source, "http");
    assert_eq!(c.deploy.http_root, std::path::Path::new("/srv/httpboot"));
    assert_eq!(c.http_url(), "http://192.0.2.10:8088");
    assert_eq!(
        c.pxe.images_path,
        std::path::Path::new("/var/lib/ironic/images")
    );
    assert_eq!(
        c.pxe.instance_master_path,
        std::path::Path::new("/var/lib/ironic-image-worker/master_images"),
        "never Ironic's master directory"
    );
    assert_eq!(c.pxe.image_cache_size, 51200);
    assert_eq!(c.pxe.image_cache_ttl, 60, "our file beats ironic.conf");
    assert_eq!(c.conductor.permitted_image_formats, ["raw", "qcow2"]);
    assert_eq!(
        c.conductor.file_url_allowed_paths,
        [
            std::path::PathBuf::from("/var/lib/ironic"),
            "/srv/images".into()
        ]
    );
    assert_eq!(c.glance.password, "gl@nce pass");
    assert_eq!(c.glance.valid_interfaces, ["internal"]);
    assert_eq!(c.glance.auth_url, "http://keystone.example.net:5000/v3");

    // Unset in ironic.conf: Ironic's defaults, and the worker's own
    // image_download_source (only an explicit setting counts).
    std::fs::write(dir.path().join("min.conf"), "[DEFAULT]\nhost = c\n").unwrap();
    let c = Config::load_from(
        &Files {
            ironic_conf: Some(dir.path().join("min.conf")),
            toml: None,
        },
        &[],
        &[],
    )
    .unwrap();
    assert_eq!(c.deploy.http_root, std::path::Path::new("/httpboot"));
    assert_eq!(c.agent.image_download_source, "local");
    assert_eq!(c.amqp.url, "amqp://guest:guest@127.0.0.1:5672/%2f");
}

#[test]
fn ironic_master_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir_all(state.join("master_images")).unwrap();
    let conf = dir.path().join("ironic.conf");
    std::fs::write(
        &conf,
        format!("[DEFAULT]\nhost = c\nstate_path = {}\n", state.display()),
    )
    .unwrap();
    let files = |toml: Option<std::path::PathBuf>| Files {
        ironic_conf: Some(conf.clone()),
        toml,
    };
    let own = |master: &str| {
        let p = dir.path().join("w.toml");
        std::fs::write(&p, format!("[pxe]\ninstance_master_path = \"{master}\"\n")).unwrap();
        Some(p)
    };
    // Ironic's default, $state_path/master_images, written another way.
    let same = format!("{}/./master_images/", state.display());
    let err = Config::load_from(&files(own(&same)), &[], &[]).unwrap_err();
    assert!(
        err.message.contains("Ironic's master image directory"),
        "{err}"
    );
    // Through a symlink too (canonical paths).
    std::os::unix::fs::symlink(&state, dir.path().join("alias")).unwrap();
    let alias = format!("{}/alias/master_images", dir.path().display());
    assert!(Config::load_from(&files(own(&alias)), &[], &[]).is_err());
    // ironic.conf's explicit setting.
    std::fs::write(
        &conf,
        format!(
            "[DEFAULT]\nhost = c\n[pxe]\ninstance_master_path = {}/m\n",
            dir.path().display()
        ),
    )
    .unwrap();
    let explicit = format!("{}/m", dir.path().display());
    assert!(Config::load_from(&files(own(&explicit)), &[], &[]).is_err());
    // A directory of its own is fine, and never taken from ironic.conf.
    let c = Config::load_from(
        &files(own(&same.replace("master_images", "worker"))),
        &[],
        &[],
    )
    .unwrap();
    assert!(c.pxe.instance_master_path.ends_with("worker"));
    let c = Config::load_from(&files(None), &[], &[]).unwrap();
    assert_eq!(
        c.pxe.instance_master_path,
        std::path::Path::new("/var/lib/ironic-image-worker/master_images")
    );
}

#[test]
fn example_configuration_is_valid_and_shows_the_defaults() {
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("ops/worker.example.toml");
    let c = Config::load_from(&toml_file(&example), &[], &[]).unwrap();
    let d = Config::load_from(&Files::default(), &[], &[]).unwrap();
    assert_eq!(format!("{:?}", c.amqp), format!("{:?}", d.amqp));
    assert_eq!(format!("{:?}", c.convert), format!("{:?}", d.convert));
    assert_eq!(format!("{:?}", c.glance), format!("{:?}", d.glance));
    assert_eq!(
        c.conductor.permitted_image_formats,
        d.conductor.permitted_image_formats
    );
    assert_eq!(c.pxe.image_cache_size, d.pxe.image_cache_size);
}
